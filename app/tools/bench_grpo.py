"""GRPO's sampling and its step: the app's GRPO run under ZeRO-3 with the whole model gathered once for sampling and
gathered layer by layer, and HF generate on the plain model (no DeepSpeed, no hooks) for as many completions of the
same length: the tokens a rank generates per second in each, and the app's whole step.

    python -m app.tools.bench_grpo --model gpt2-124m [--prompts 2] [--prompt_len 32] [--num_generations 4]
        [--max_completion_length 32] [--steps 3] [--deepspeed_config ds_configs/zero3.json]
        [--launcher "deepspeed --num_gpus 2"] [--output_dir runs/bench-grpo] [-- more train.py flags]

The runs sample from a model of random weights, every reward 0, one micro batch of --prompts a rank each step.
Each run's figures are the medians of its log rows but the first (the step that builds and warms up):
`sampling_s`, the seconds a rank's step spends sampling and scoring; `completions/mean_length`; `samples_per_s`,
prompts per second of whole steps over every rank. HF generate runs in this process on the same device and in the
same precision, the same rows sampled to --max_completion_length tokens, after one warm-up call. Writes report.json
in --output_dir.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from app.ds.config import load_ds_config
from app.errors import UserError, report
from app.observe.runlog import read_rows
from app.tools.bench_packing import REPO, command_start

MODES = {"gathered": "on", "layered": "off"}
REWARD = "def zero(completions, **kwargs):\n    return [0.0] * len(completions)\n"


def write_inputs(folder: Path, args) -> tuple:
    """(prompts.jsonl: enough prompts of --prompt_len characters (a byte tokenizer's tokens), the zero reward, the
    DeepSpeed JSON at one micro batch of --prompts a rank and no accumulation)."""
    ds = load_ds_config(args.deepspeed_config, resolve=False)  # a JSON or an accelerate file, checked; before writing
    folder.mkdir(parents=True, exist_ok=True)
    letters = "abcdefghijklmnopqrstuvwxyz "
    with open(folder / "prompts.jsonl", "w") as f:
        for r in range(args.prompts * 64 * (args.steps + 1)):
            f.write(json.dumps({"prompt": "".join(letters[(r * 7 + i * 3) % 27] for i in range(args.prompt_len))})
                    + "\n")
    (folder / "rewards.py").write_text(REWARD)
    ds = {**{k: v for k, v in ds.items() if k != "train_batch_size"}, "train_micro_batch_size_per_gpu": args.prompts,
          "gradient_accumulation_steps": 1}
    (folder / "ds_config.json").write_text(json.dumps(ds))
    return folder / "prompts.jsonl", f"{folder / 'rewards.py'}:zero", folder / "ds_config.json"


def command(args, mode: str, inputs: tuple, extra: list) -> list:
    """The app's GRPO run of one mode, every step logged."""
    prompts, reward, ds = inputs
    return command_start(args.launcher) + [
        "--task", "grpo", "--model", args.model, "--tokenizer", "bytes", "--dataset", str(prompts), "--reward",
        reward, "--num_generations", str(args.num_generations), "--max_completion_length",
        str(args.max_completion_length), "--deepspeed_config", str(ds), "--max_steps", str(args.steps + 1),
        "--log_interval", "1", "--eval_interval", str(10 ** 6), "--eval_answers", "0", "--eval_fraction", "0.01",
        "--gather_for_generation", MODES[mode], "--overwrite", "--output_dir", str(Path(args.output_dir) / mode),
        *extra]


def rates(rows: list, ranks: int, prompts: int, group: int) -> dict:
    """A mode's figures from its training rows of metrics.csv (the first left out): a rank's generated tokens per
    second while sampling, the seconds a step takes, and its share spent sampling."""
    rows = [row for row in rows if row.get("sampling_s") is not None][1:]
    sampling = statistics.median(row["sampling_s"] for row in rows)
    length = statistics.mean(row["completions/mean_length"] for row in rows)
    step = statistics.median(ranks * prompts / row["samples_per_s"] for row in rows)
    return {"tokens_per_s": prompts * group * length / sampling, "sampling_s": sampling, "mean_length": length,
            "step_s": step, "sampling_share": sampling / step, "steps": len(rows)}


def plain_generate(model: str, rows: int, prompt_len: int, new: int, repeats: int) -> dict:
    """HF generate on the plain transformers model (built from its preset's config, random weights; bf16 autocast
    on a GPU as the app's runs), rows sequences of prompt_len tokens each sampled to exactly new tokens: a rank's
    tokens per second, the median of repeats calls after a warm-up."""
    import torch
    from transformers import AutoModelForCausalLM
    from app.core.models import hf_spec
    config = hf_spec(model).config
    cuda = torch.cuda.is_available()
    net = AutoModelForCausalLM.from_config(config).to("cuda" if cuda else "cpu").eval()
    ids = torch.randint(0, min(config.vocab_size, 256), (rows, prompt_len), device=net.device)
    seconds = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        with torch.no_grad(), torch.autocast(net.device.type, torch.bfloat16, enabled=cuda):
            net.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, max_new_tokens=new,
                         min_new_tokens=new, pad_token_id=0)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return {"tokens_per_s": rows * new / statistics.median(seconds[1:]), "sampling_s": statistics.median(seconds[1:])}


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m app.tools.bench_grpo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a transformers preset (gpt2-124m, llama-1b, ...)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts a rank samples each step (default: 2)")
    parser.add_argument("--prompt_len", type=int, default=32, help="characters (byte tokens) a prompt (default: 32)")
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--max_completion_length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="measured steps, after one that warms up (default: 3)")
    parser.add_argument("--deepspeed_config", default=str(REPO / "ds_configs" / "zero3.json"))
    parser.add_argument("--launcher", default="", help='e.g. "deepspeed --num_gpus 2" (default: one process)')
    parser.add_argument("--output_dir", default="runs/bench-grpo")
    args, extra = parser.parse_known_args(argv)
    return args, [a for a in extra if a != "--"]


def main(argv=None) -> int:
    args, extra = parse(argv)
    try:
        inputs, found = write_inputs(Path(args.output_dir) / "inputs", args), {}
    except UserError as e:
        return report(e)
    for mode in MODES:
        done = subprocess.run(command(args, mode, inputs, extra), capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            errors = [line for line in (done.stdout + done.stderr).splitlines() if "error:" in line]
            print(f"error: the {mode} run failed (exit {done.returncode}): "
                  f"{errors[-1] if errors else (done.stdout + done.stderr)[-2000:]}")
            return done.returncode
        run = Path(args.output_dir) / mode
        ranks = json.loads((run / "summary.json").read_text())["world_size"]
        found[mode] = rates(read_rows(run / "metrics.csv"), ranks, args.prompts, args.num_generations)
    found["hf_generate"] = plain_generate(args.model, args.prompts * args.num_generations, args.prompt_len,
                                          args.max_completion_length, args.steps)
    for mode, row in found.items():
        step = f", step {row['step_s']:.3f} s ({row['sampling_share']:.0%} sampling)" if "step_s" in row else ""
        print(f"{mode:11} {row['tokens_per_s']:9.1f} generated tokens/s a rank, sampling {row['sampling_s']:.3f} s"
              f"{step}")
    for mode in MODES:
        found[mode]["over_hf_generate"] = found[mode]["tokens_per_s"] / found["hf_generate"]["tokens_per_s"]
        print(f"headline {mode} / HF generate: {found[mode]['over_hf_generate']:.2f}x the generated tokens per "
              f"second")
    result = {**found, "model": args.model, "launcher": args.launcher or "python", "extra": extra,
              **{k: getattr(args, k) for k in ("prompts", "prompt_len", "num_generations", "max_completion_length",
                                               "steps", "deepspeed_config")}}
    (Path(args.output_dir) / "report.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
