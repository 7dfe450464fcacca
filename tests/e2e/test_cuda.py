"""The CUDA paths, run when the machine has a GPU: no host sync in the app's step, the app's changes to DeepSpeed's
step against stock DeepSpeed, the memory plan against the GPU's peak, auto device, auto precision, every ZeRO stage,
compile, a diverging run, NCCL, and two ranks sharing one GPU behind a device group that refuses CPU tensors.
scripts/gpu_check.py runs them in parts, most telling first (the order below)."""
import functools
import subprocess
import sys

import pytest

from conftest import REPO, cuda_env, launch_script, read_metrics, read_summary, train, train_jobs
from helpers.host_syncs import check_preference_waits, check_report, count_in_launch, sync_job

pytestmark = pytest.mark.cuda


@functools.lru_cache(maxsize=1)
def gpus() -> int:
    """CUDA devices the machine has (the rest of the suite hides them), asked of a fresh interpreter."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, env=cuda_env(), timeout=120)
    return int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0


def figure(name: str, value: float):
    """A figure of the GPU check's report (scripts/gpu_check.py reads GPU_CHECK_FIGURES), also printed."""
    import os
    print(f"figure: {name} {value:.3g}")
    if os.environ.get("GPU_CHECK_FIGURES"):
        with open(os.environ["GPU_CHECK_FIGURES"], "a") as f:
            f.write(f"{name} {value:.3g}\n")


def need(count: int):
    if gpus() < count:
        pytest.skip(f"needs {count} CUDA device(s); this machine has {gpus()}")


def gpu_train(out, *args, launcher="python", nproc=1):
    return train(launcher, nproc, "--max_steps", 12, "--log_interval", 1, "--output_dir", out, *args,
                 base_env=cuda_env())


def _corpus(tmp_path):
    from conftest import write_text_rows
    return write_text_rows(tmp_path / "corpus.txt", 600)


SHARED = {"APP_SHARE_GPU": "1"}  # both ranks on cuda:0, the device group gloo for CUDA alone


def test_no_training_step_synchronises_the_gpu(tmp_path):
    """The host-sync harness on CUDA, with torch.cuda.set_sync_debug_mode("error") over the counted steps: any
    synchronising CUDA call there, DeepSpeed's CUDA-only branches included, fails the run. Not ZeRO-3, whose stock
    step synchronizes streams by design (docs/gpu.md, "No host synchronisation in the app's step")."""
    need(1)
    names = [(name, mode) for mode in ("off", "on") for name in ("dp", "zero2")]
    reports = count_in_launch(1, [sync_job(name, mode, tmp_path / f"{name}-{mode}") for name, mode in names],
                              "--cuda_errors", base_env=cuda_env())
    for (name, mode), report in zip(names, reports):
        check_report(name, report)


def test_skipped_steps_and_bf16_weights_step_as_stock_deepspeed_on_two_ranks_sharing_the_gpu():
    """tests/helpers/stock_steps.py on CUDA with real fused AdamW kernels: the step skipped on the device and the
    bf16 weights' step against stock DeepSpeed's, 2 ranks on one GPU."""
    need(1)
    import tempfile
    from helpers.stock_steps import cases_in, judge
    cases = ["0:fp32:1", "1:fp32:1", "2:fp32:1", "3:fp32:1", "0:bf16:1", "2:bf16:1", "3:bf16:1", "2:fp32:4"]
    with tempfile.TemporaryDirectory() as report:
        result = launch_script(2, "tests/helpers/stock_steps.py", report, *cases, base_env={**cuda_env(), **SHARED})
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        seen = cases_in(report, cases, 2)
    figure("stock_steps_largest_weight_difference", max(what["weights"] for case, what in seen if case.endswith(":1")))
    for case, what in seen:
        judge(case, what, tolerance=1e-6)


def test_the_apps_losses_are_stock_deepspeeds_on_the_gpu(tmp_path):
    """The digits CNN in bf16 for 20 steps under ZeRO 1, 2, 3 and bf16 weights: the app's losses against stock
    DeepSpeed's (tests/helpers/stock_deepspeed.py), step by step."""
    need(1)
    from helpers.stock_steps import bf16_weights_config, losses_against_stock
    configs = {name: REPO / "ds_configs" / f"{name}.json" for name in ("zero1", "zero2", "zero3")}
    configs["bf16-zero0"] = bf16_weights_config(tmp_path, 0)
    args = ["--max_steps", 20, "--eval_interval", 20, "--compile", "off"]
    differences = losses_against_stock(tmp_path, configs, args, base_env=cuda_env())
    for name, difference in differences.items():
        figure(f"losses_vs_stock_{name}", difference)
    assert all(difference <= 1e-3 for difference in differences.values()), differences


def test_the_plan_predicts_the_peak_the_gpu_reaches(tmp_path):
    """The memory plan's predicted peak against torch.cuda.max_memory_allocated of the same run: within 10%."""
    need(1)
    config = REPO / "ds_configs" / "dp.json"
    gpu_train(tmp_path / "run", "--deepspeed_config", config, "--model", "gpt2-tiny", "--dataset", _corpus(tmp_path),
              "--block_size", 128, "--compile", "off")
    measured = read_summary(tmp_path / "run")["peak_memory_bytes"]
    planned = subprocess.run([sys.executable, "-m", "app.tools.plan", "--model", "gpt2-tiny", "--seq_len", "128",
                              "--world_size", "1", "--deepspeed_config", str(config), "--compile", "off"], cwd=REPO,
                             capture_output=True, text=True, env=cuda_env(), timeout=300)
    assert planned.returncode == 0, planned.stderr
    header, row = (line.split() for line in planned.stdout.splitlines()[1:3])
    peak = float(row[header.index("peak")]) * 1e9
    figure("plan_peak_over_measured", peak / measured)
    assert abs(peak - measured) <= 0.1 * measured, (peak, measured)


def test_preference_tuning_under_zero3_on_two_ranks_sharing_the_gpu(tmp_path):
    """DPO in bf16 autocast under ZeRO-3 on 2 ranks sharing the GPU, against each reference: a frozen copy and the
    adapters off (LoRA), each live and precomputed. The first step's loss is log 2 (the reference is the policy), a
    precomputed reference trains as the live one does, and the worked example learns the preferred answers."""
    need(1)
    import math
    from app.tools.instructions import write_model, write_pairs
    base = ["--model", write_model(tmp_path, seed=0), "--dataset", write_pairs(tmp_path, 2000, seed=0),
            "--block_size", 128, "--deepspeed_config", REPO / "ds_configs" / "zero3.json", "--eval_answers", 0]
    jobs = {f"{kind} {reference}": [*base, "--max_steps", 6, "--log_interval", 1, "--reference", reference,
                                    *(["--lora"] if kind == "lora" else [])]
            for kind in ("copy", "lora") for reference in ("live", "precompute")}
    jobs["learnt"] = [*base, "--max_steps", 40, "--eval_interval", 20, "--log_interval", 10]
    outputs = dict(zip(jobs, train_jobs("ranks", 2, [[*argv, "--output_dir", tmp_path / name.replace(" ", "-")]
                                                     for name, argv in jobs.items()],
                                        base_env={**cuda_env(), **SHARED})))
    losses = {name: [r["loss"] for r in read_metrics(tmp_path / name.replace(" ", "-"))[0]] for name in jobs}
    for kind in ("copy", "lora"):
        live, precomputed = losses[f"{kind} live"], losses[f"{kind} precompute"]
        apart = max(abs(a - b) for a, b in zip(live, precomputed))
        figure(f"preference_{kind}_first_loss_minus_log2", live[0] - math.log(2))
        figure(f"preference_{kind}_live_vs_precomputed", apart)
        assert "cuda:gloo on cuda" in outputs[f"{kind} live"] and "precision: bf16 autocast" in outputs[f"{kind} live"]
        assert abs(live[0] - math.log(2)) < 1e-3 and live[-1] < live[0], (kind, live)
        assert len(precomputed) == 6 and apart < 2e-2, (kind, live, precomputed)
    train_rows, held = read_metrics(tmp_path / "learnt")
    accuracy = [row["eval_reward_accuracy"] for row in held]
    figure("preference_learnt_eval_reward_accuracy", accuracy[-1])
    assert train_rows[-1]["reward_margin"] > 0 and accuracy[-1] >= 0.85, accuracy
    assert read_summary(tmp_path / "learnt")["precision"] == "bfloat16"


def test_grpo_learns_under_zero3_on_two_ranks_sharing_the_gpu(tmp_path):
    """docs/rl.md's worked example on the GPU, in bf16 autocast under ZeRO-3 on 2 ranks: the tuned model's held-out
    reward rises in 60 steps of GRPO (sampling's speed: the GPU check's grpo_bench part, app.tools.bench_grpo)."""
    need(1)
    from app.tools.instructions import write_prompts
    from e2e.test_grpo import evaluations, lr_copy, worked_example, worked_start
    env = {**cuda_env(), **SHARED}
    prompts = write_prompts(tmp_path / "rl", 600, seed=1)
    example = worked_example(worked_start(tmp_path, base_env=env), prompts)
    jobs = {"before": [*example, "--deepspeed_config", lr_copy(tmp_path, 0.0), "--max_steps", 1],
            "learnt": [*example, "--deepspeed_config", lr_copy(tmp_path, 5e-4)]}
    outputs = dict(zip(jobs, train_jobs("ranks", 2, [[*argv, "--output_dir", tmp_path / name]
                                                     for name, argv in jobs.items()], base_env=env)))
    start, rewards = read_summary(tmp_path / "before")["eval_reward"], [r["eval_reward"] for r in
                                                                          evaluations(tmp_path / "learnt")]
    figure("grpo_eval_reward_before", start)
    figure("grpo_eval_reward_learnt", rewards[-1])
    assert "precision: bf16 autocast" in outputs["learnt"] and "cuda:gloo on cuda" in outputs["learnt"]
    assert "sampling gathers the whole model once" in outputs["learnt"]
    assert rewards[-1] > start, (start, rewards)


def _long_corpus(tmp_path):
    """docs/long-context.md's corpus: the first 40 modules of Python's standard library (1.0 MB of real text)."""
    import os
    from pathlib import Path
    folder = Path(os.__file__).parent
    path = tmp_path / "long.txt"
    path.write_text("".join(p.read_text() for p in sorted(folder.glob("*.py"))[:40]))
    return path


def test_long_sequences_split_over_two_ranks_sharing_the_gpu(tmp_path):
    """llama-tiny-long at 8,192 tokens in bf16 autocast: SP=2 on 2 ranks sharing the GPU (DeepSpeed's all-to-all on
    CUDA tensors) against one process, 6 steps, within bf16's reach."""
    need(1)
    from conftest import config_variant
    args = ["--model", "llama-tiny-long", "--dataset", _long_corpus(tmp_path), "--block_size", 8192,
            "--max_steps", 6, "--log_interval", 1, "--eval_interval", 6, "--compile", "off"]
    one = config_variant(tmp_path, "dp", train_micro_batch_size_per_gpu=1)
    two = config_variant(tmp_path, "sequence_parallel", train_micro_batch_size_per_gpu=1)
    train_jobs("python", 1, [[*args, "--deepspeed_config", one, "--output_dir", tmp_path / "one"]],
               base_env=cuda_env())
    out = train_jobs("ranks", 2, [[*args, "--deepspeed_config", two, "--output_dir", tmp_path / "sp2"]],
                     base_env={**cuda_env(), **SHARED})[0]
    whole, split = ([r["loss"] for r in read_metrics(tmp_path / name)[0]] for name in ("one", "sp2"))
    apart = max(abs(a - b) for a, b in zip(whole, split))
    figure("long_sp2_vs_one_largest_loss_difference", apart)
    for name in ("one", "sp2"):
        figure(f"long_{name}_peak_gb", read_summary(tmp_path / name)["peak_memory_bytes"] / 1e9)
    assert "sequence parallel: DeepSpeed Ulysses splits each sequence over 2 ranks" in out
    assert len(split) == 6 and apart < 2e-2 * whole[0], (whole, split)


def test_tiled_mlps_lower_the_peak_of_a_long_sequence_on_the_gpu(tmp_path):
    """llama-1b at 16,384 tokens, micro batch 1, bf16 autocast under ZeRO-3: its MLPs tiled and whole, each peak
    against the other and against the plan's (planned on the host's cores while the GPU trains: the plan is CPU
    work, and the GPU check's minutes are few), which must not be below the whole run's. The two runs share a
    process (tests/helpers/jobs.py), which lets go of the first's ZeRO-3 engine before the second starts."""
    need(1)
    from conftest import config_variant
    config = REPO / "ds_configs" / "zero3.json"
    args = ["--model", "llama-1b", "--dataset", _long_corpus(tmp_path), "--block_size", 16384, "--max_steps", 2,
            "--log_interval", 1, "--eval_interval", 0, "--compile", "off", "--deepspeed_config",
            config_variant(tmp_path, "zero3", train_micro_batch_size_per_gpu=1)]
    said = {name: open(tmp_path / f"plan.{name}", "w+") for name in ("out", "err")}  # no pipe to fill and stall
    planning = subprocess.Popen([sys.executable, "-m", "app.tools.plan", "--model", "llama-1b", "--seq_len", "16384",
                                 "--micro_batch", "1", "--world_size", "1", "--deepspeed_config", str(config),
                                 "--compile", "off", "--gpu_memory", "150GB"], cwd=REPO, stdout=said["out"],
                                stderr=said["err"], env={**cuda_env(), "CUDA_VISIBLE_DEVICES": ""})
    try:
        train_jobs("python", 1, [[*args, "--tiled", choice, "--output_dir", tmp_path / choice]
                                 for choice in ("on", "off")], base_env=cuda_env())
        planning.wait(timeout=300)
    finally:
        if planning.poll() is None:
            planning.kill()
            planning.wait()
        for file in said.values():
            file.close()
    peaks = {choice: read_summary(tmp_path / choice)["peak_memory_bytes"] for choice in ("on", "off")}
    stdout = (tmp_path / "plan.out").read_text()
    assert planning.returncode == 0, (tmp_path / "plan.err").read_text()[-3000:]
    lines = stdout.splitlines()  # after DeepSpeed's line that it found no GPU (hidden from the plan)
    at = next((i for i, line in enumerate(lines) if line.startswith("config ")), None)
    assert at is not None, stdout
    header, row = lines[at].split(), lines[at + 1].split()
    figure("long_llama1b_16k_peak_gb_tiled", peaks["on"] / 1e9)
    figure("long_llama1b_16k_peak_gb_whole", peaks["off"] / 1e9)
    planned = float(row[header.index("peak")]) * 1e9 / peaks["off"]
    figure("long_llama1b_16k_plan_over_whole", planned)
    assert peaks["on"] < peaks["off"], peaks
    assert planned >= 0.95, f"the plan puts the whole run's peak at {planned:.3f} of the GPU's: out of memory ahead"


def test_no_preference_step_waits_on_the_gpu_but_the_models_own(tmp_path):
    """tests/e2e/test_host_syncs.py's preference count on CUDA, 2 ranks sharing the GPU."""
    need(1)
    check_preference_waits(tmp_path, base_env={**cuda_env(), **SHARED})


def test_fp32_on_cuda_uses_tf32_unless_turned_off(tmp_path):
    need(1)
    fp32 = tmp_path / "fp32.json"
    fp32.write_text((REPO / "ds_configs" / "dp.json").read_text().replace('"enabled": "auto"', '"enabled": false'))
    common = ["--deepspeed_config", fp32, "--compile", "off", "--max_steps", 12, "--log_interval", 1]
    on, off = train_jobs("python", 1, [[*common, "--output_dir", tmp_path / "on"],
                                       [*common, "--output_dir", tmp_path / "off", "--tf32", "off"]],
                         base_env=cuda_env())
    assert "precision: fp32; TF32 matmuls" in on
    assert "precision: fp32; full-fp32 matmuls (--tf32 off)" in off


def test_two_ranks_sharing_one_gpu_make_no_host_sync(tmp_path):
    need(1)
    names = [(name, mode) for mode in ("off", "on") for name in ("dp", "zero1", "zero2", "zero3")]
    reports = count_in_launch(2, [sync_job(name, mode, tmp_path / f"{name}-{mode}") for name, mode in names],
                              base_env={**cuda_env(), **SHARED})
    for (name, mode), report in zip(names, reports):
        check_report(name, report)


def test_auto_takes_bf16_weights_where_only_they_fit_the_gpu(tmp_path):
    """A micro batch that the plan puts over this GPU under bf16 autocast (fp32 weights) and under it with bf16
    weights: precision "auto" takes bf16 weights, says why on its precision line, and the run trains."""
    need(1)
    import json
    from app.core import resolver
    from app.ds import precision
    from app.ds.config import load_ds_config
    from app.memory import estimate, planner
    from app.settings import Settings
    from conftest import write_text_rows
    memory = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_properties(0)"
                                 ".total_memory)"], capture_output=True, text=True, env=cuda_env()).stdout)
    ds, _ = precision.resolve_precision(load_ds_config(REPO / "ds_configs" / "dp.json", resolve=False), "dp.json",
                                        cuda=True, bf16_ok=True)
    task = resolver.build(Settings(model="gpt2-124m", block_size=1024))
    found = planner.plans(planner.workload(task, 1024), {"autocast": ds, "bf16": planner.with_bf16_weights(ds)}, 1)
    usable = estimate.USABLE * memory
    micro = next(m for m in range(1, 4096) if found["autocast"].peak(m) > usable)
    assert found["bf16"].peak(micro) <= usable, "the plan leaves bf16 weights no micro batch of their own here"
    config = tmp_path / "dp.json"
    config.write_text(json.dumps({**json.loads((REPO / "ds_configs" / "dp.json").read_text()),
                                  "train_micro_batch_size_per_gpu": micro}))
    result = train("python", 1, "--max_steps", 2, "--output_dir", tmp_path / "run", "--deepspeed_config", config,
                   "--model", "gpt2-124m", "--dataset", write_text_rows(tmp_path / "corpus.txt", 20000),  # 600 blocks
                   "--block_size", 1024, "--compile", "off", base_env=cuda_env())
    assert f'precision: bf16 (torch_autocast "auto" gave way to bf16 weights: the memory plan puts a micro batch of ' \
           f'{micro} at ' in result.stdout, result.stdout[-3000:]
    assert read_summary(tmp_path / "run")["precision"] == "bfloat16"


def test_micro_batch_auto_at_the_gpus_edge_trains_without_running_out_of_memory(tmp_path):
    """"train_micro_batch_size_per_gpu": "auto" where the global batch is far past what the GPU holds: gpt2-124m at
    1,024 tokens, 512 samples a step, compiled in bf16 autocast as a GPU run is. The search's real steps run out of
    memory at the large micro batches and take the largest that ran; the run then trains and evaluates on it
    without an out-of-memory error of its own."""
    need(1)
    import json
    from conftest import write_text_rows
    config = tmp_path / "dp-auto.json"
    shipped = json.loads((REPO / "ds_configs" / "dp.json").read_text())
    config.write_text(json.dumps({**{k: v for k, v in shipped.items() if k != "gradient_accumulation_steps"},
                                  "train_micro_batch_size_per_gpu": "auto", "train_batch_size": 512}))
    result = train("python", 1, "--max_steps", 2, "--log_interval", 1, "--eval_interval", 2, "--output_dir",
                   tmp_path / "run", "--deepspeed_config", config, "--model", "gpt2-124m", "--dataset",
                   write_text_rows(tmp_path / "corpus.txt", 40000), "--block_size", 1024, base_env=cuda_env(),
                   timeout=900)
    line = next(line for line in result.stdout.splitlines() if line.startswith("micro batch: "))
    micro = int(line.split('"auto" picked ')[1].split(",")[0])
    summary = read_summary(tmp_path / "run")
    memory = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_properties(0)"
                                 ".total_memory)"], capture_output=True, text=True, env=cuda_env()).stdout)
    figure("auto_micro_batch_gpt2_124m_1024", micro)
    figure("auto_micro_batch_peak_over_gpu", summary["peak_memory_bytes"] / memory)
    assert "out of memory" in line and micro < 512, line  # the search met the edge
    assert len(read_metrics(tmp_path / "run")[0]) == 2, "both steps trained"


def test_one_gpu_auto_mode_compiles_and_picks_bf16(tmp_path):
    need(1)
    result = gpu_train(tmp_path / "run")
    assert "mode: no launcher and one GPU: plain single-device training on cuda:0" in result.stdout
    assert 'precision: bf16 autocast (torch_autocast "auto": the CUDA device supports bf16)' in result.stdout
    assert "compile: compiling the model and its loss" in result.stdout and "could not be compiled" not in result.stdout
    summary = read_summary(tmp_path / "run")
    assert summary["precision"] == "bfloat16" and summary["peak_memory_bytes"] > 0
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")[0]]
    assert losses[-1] < losses[0]


def test_every_zero_stage_trains_in_bf16_on_one_gpu_and_a_diverging_run_stops(tmp_path):
    """Each ZeRO stage trains gpt2-tiny compiled in bf16 (one launch, the jobs one after another); and a ZeRO-3 run
    whose learning rate diverges skips and counts its steps on the device and ends in one line."""
    need(1)
    import json
    corpus = _corpus(tmp_path)
    names = ["dp", "zero1", "zero2", "zero3", "zero2_offload"]
    common = ["--model", "gpt2-tiny", "--dataset", corpus, "--max_steps", 12, "--log_interval", 1]
    jobs = [["--deepspeed_config", REPO / "ds_configs" / f"{name}.json", *common, "--output_dir", tmp_path / name]
            for name in names]
    diverging = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    diverging["optimizer"]["params"]["lr"] = 1e6
    (tmp_path / "diverging.json").write_text(json.dumps(diverging))
    jobs.append(["--deepspeed_config", tmp_path / "diverging.json", *common, "--max_nonfinite_steps", 3,
                 "--save_interval", 2, "--output_dir", tmp_path / "diverging"])
    outputs = train_jobs("ranks", 1, jobs, base_env=cuda_env(), codes=[0] * len(names) + [2])
    for name in names:
        summary = read_summary(tmp_path / name)
        assert summary["precision"] == "bfloat16" and 0 < summary["mfu"] < 1, name
        losses = [r["loss"] for r in read_metrics(tmp_path / name)[0]]
        assert losses[-1] < losses[0], name
    assert "error: the run diverged: its loss or gradient norm has not been finite since step " in outputs[-1], \
        outputs[-1][-3000:]
    assert "skipped_steps" in outputs[-1], outputs[-1][-3000:]


def test_a_one_stage_pipeline_trains_in_bf16_on_one_gpu(tmp_path):
    """DeepSpeed's pipeline engine on CUDA (one GPU holds one stage): bf16, the tied GPT-2 split, eval."""
    need(1)
    from conftest import config_variant
    config = config_variant(tmp_path, "pipeline", pipeline={"stages": 1})
    result = gpu_train(tmp_path / "run", "--deepspeed_config", config, "--model", "gpt2-tiny",
                       "--dataset", _corpus(tmp_path))
    assert "pipeline: 1 stage x 1 data-parallel replica(s)" in result.stdout
    assert "compile: pipeline stages run eager" in result.stdout
    summary = read_summary(tmp_path / "run")
    assert summary["precision"] == "bfloat16" and summary["pipeline_stages"] == 1
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")[0]]
    assert losses[-1] < losses[0]


def test_two_ranks_share_one_gpu_behind_a_device_only_group(tmp_path):
    """The multi-rank CUDA paths on a one-GPU machine: a CPU tensor handed to the device group fails there as
    on NCCL, so summaries, throughput probes, stop votes and checkpoints must all keep to the host group."""
    need(1)
    corpus = _corpus(tmp_path)
    names = ("dp", "zero1", "zero2", "zero3")
    jobs = [["--deepspeed_config", REPO / "ds_configs" / f"{name}.json", "--model", "gpt2-tiny", "--dataset", corpus,
             "--max_steps", 8, "--log_interval", 2, "--save_interval", 4, "--output_dir", tmp_path / name]
            for name in names]
    outputs = train_jobs("ranks", 2, jobs, base_env={**cuda_env(), **SHARED})
    for name, output in zip(names, outputs):
        assert "cuda:gloo on cuda" in output, output[-2000:]
        summary = read_summary(tmp_path / name)
        assert summary["world_size"] == 2 and summary["precision"] == "bfloat16" and summary["tokens_per_s"] > 0
        losses = [r["loss"] for r in read_metrics(tmp_path / name)[0]]
        assert losses[-1] < losses[0], name


def test_two_ranks_with_nccl(tmp_path):
    need(2)
    result = gpu_train(tmp_path / "run", "--deepspeed_config", REPO / "ds_configs" / "zero2.json",
                       launcher="deepspeed", nproc=2)
    assert "nccl on cuda" in result.stdout and read_summary(tmp_path / "run")["world_size"] == 2


@pytest.mark.parametrize("name, model", [("pipeline", "gpt2-tiny"), ("tensor_parallel", "llama-tiny")])
def test_model_parallel_configs_on_two_gpus_with_nccl(name, model, tmp_path):
    need(2)
    result = gpu_train(tmp_path / "run", "--deepspeed_config", REPO / "ds_configs" / f"{name}.json", "--model", model,
                       "--dataset", _corpus(tmp_path), launcher="deepspeed", nproc=2)
    assert "nccl on cuda" in result.stdout
    summary = read_summary(tmp_path / "run")
    assert summary["world_size"] == 2 and summary["precision"] == "bfloat16"
    assert summary["pipeline_stages" if name == "pipeline" else "tensor_parallel_size"] == 2
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")[0]]
    assert losses[-1] < losses[0]
