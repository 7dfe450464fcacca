"""The GPU check: the parts that only a CUDA GPU can prove, each in its own time limit, one after another (a part that
fails or runs out of time does not stop the rest), then one table and OUT_DIR/report.json. Run through
scripts/gpu_check.sh (docs/gpu.md, "The GPU check"):

    python3 scripts/gpu_check.py OUT_DIR [--only NAME,...] [--budget SECONDS] [--limit NAME=SECONDS ...]

A part's log is OUT_DIR/<name>.log; the figures its tests write (GPU_CHECK_FIGURES, a `name value` line each) and the
benchmark's headline go into the report. On a machine without a CUDA GPU each part says so and the report is still
written (the check's own plumbing).
"""
import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NEEDS_CUDA = 77  # a part's exit code when the machine has no CUDA GPU
BENCHES = ("llama-1b", "llama-1b-16k", "llama-8b", "gpt2-124m", "bf16-weights", "llama-1b-zero3",  # bench() folders
           "llama-3b")


@dataclass
class Part:
    name: str
    limit_s: int
    command: list
    what: str


def cuda_test(expression: str) -> list:
    """pytest over tests/e2e/test_cuda.py's tests matching a -k expression (-v: each test's outcome as it ends; a
    failure's traceback as it fails, so a part cut off by its limit still says why)."""
    return [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "tests.helpers.failures_at_once",
            "tests/e2e/test_cuda.py", "-k", expression]


def bench(out: Path, name: str, *argv) -> list:
    """python -m app.tools.bench with argv, its rows and profiles in out/name, unplanned: the plan is CPU work, made
    after the check on any machine (python -m app.tools.bench_replan OUT/name), not in the GPU's minutes."""
    return [sys.executable, "-m", "app.tools.bench", *map(str, argv), "--plan", "off", "--output_dir", str(out / name)]


def bf16_weights(out: Path) -> dict:
    """{name: path} of ds_configs' dp.json and zero3.json with DeepSpeed's bf16 section (16-bit weights, fp32
    masters) in place of bf16 autocast, written in out/configs."""
    paths = {}
    for name in ("dp", "zero3"):
        ds = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
        ds = {**{k: v for k, v in ds.items() if k != "torch_autocast"}, "bf16": {"enabled": True}}
        paths[name] = out / "configs" / f"{name}-bf16.json"
        paths[name].parent.mkdir(parents=True, exist_ok=True)
        paths[name].write_text(json.dumps(ds, indent=1) + "\n")
    return paths


def zero3_variants(out: Path) -> dict:
    """{name: path} of ds_configs/zero3.json less one of DeepSpeed's own settings it sets, or with one more, written
    in out/configs: a bench row each says what a setting buys. stock: DeepSpeed's defaults (a hook on every
    submodule, DeepSpeed's prefetch bucket); deepcompile: DeepSpeed's compiler of ZeRO-3's gathers and releases."""
    base = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    shipped = base["zero_optimization"]
    sections = {"zero3-stock": {k: v for k, v in shipped.items() if k in ("stage", "overlap_comm",
                                                                           "contiguous_gradients")},
                "zero3-nomel": {**shipped, "memory_efficient_linear": False},  # torch's linear: compiles whole
                "zero3-persist": {**shipped, "stage3_param_persistence_threshold": 10**10,  # nothing partitioned
                                  "model_persistence_threshold": 10**12}}
    files = {name: {**base, "zero_optimization": section} for name, section in sections.items()}
    files["zero3-deepcompile"] = {**base, "compile": {"deepcompile": True}}
    (out / "configs").mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, ds in files.items():
        paths[name] = out / "configs" / f"{name}.json"
        paths[name].write_text(json.dumps(ds, indent=1) + "\n")
    return paths


def parts(out: Path) -> list:
    """The parts, in the order they run: what the GPU path must prove first comes first. The first two are sized
    for the check's 9 minutes; a later call takes the rest (--only)."""
    z3, sixteen = zero3_variants(out), bf16_weights(out)
    llama = ("--model", "llama-1b", "--batch", 8, "--seq_len", 2048, "--ranks", 1, "--steps", 4, "--warmup", 2)
    gpt2 = ("--model", "gpt2-124m", "--batch", 32, "--seq_len", 1024, "--ranks", 1, "--steps", 3, "--warmup", 1)
    return [
        Part("llama_1b", 290, bench(out, "llama-1b", *llama, "--modes", "raw-compile,fsdp2,app", "--configs",
                                    "zero3,dp,zero1,zero2", "--profile", "zero3,zero1"),
             "llama-1b, micro 8 x 2,048, bf16, compiled: raw + compile, FSDP2, the app at ZeRO 0-3, ZeRO-3's and "
             "ZeRO-1's steps profiled, with what their peaks hold"),
        Part("long_context", 240, cuda_test("long_sequence"),
             "llama-tiny-long at 8,192 tokens split over 2 ranks sharing the GPU against one process; llama-1b at "
             "16,384 tokens under ZeRO-3 with its MLPs tiled and whole: peaks against each other and the plan's"),
        Part("long_peak", 150, bench(out, "llama-1b-16k", "--model", "llama-1b", "--batch", 1, "--seq_len", 16384,
                                     "--ranks", 1, "--modes", "app", "--configs", "zero3", "--compile", "off",
                                     "--steps", 2, "--warmup", 1, "--profile", "zero3+eager"),
             "llama-1b at 16,384 tokens, micro 1, under ZeRO-3, eager, its MLPs whole: the step profiled, with what "
             "its peak holds"),
        Part("llama_8b_lora", 240, bench(out, "llama-8b", "--model", "llama-8b", "--lora", "only", "--batch", 2,
                                         "--seq_len", 2048, "--ranks", 1, "--modes", "app", "--configs", "zero3",
                                         "--steps", 3, "--warmup", 1),
             "llama-8b (Llama 3.1 8B's shape) with LoRA under ZeRO-3, micro 2 x 2,048, bf16, compiled"),
        Part("gpt2_plan", 200, bench(out, "gpt2-124m", *gpt2, "--modes", "raw-compile,app", "--configs",
                                     "zero3,dp,zero2,zero1", "--compile", "on,off", "--profile", "zero3+compile"),
             "gpt2-124m, micro 32 x 1,024, bf16 autocast: the app at ZeRO 0-3 compiled and eager, for their peaks; "
             "ZeRO-3's compiled step profiled, with what its peak holds"),
        Part("bf16_weights", 150, bench(out, "bf16-weights", *gpt2, "--modes", "app", "--configs",
                                        f"{sixteen['dp']},{sixteen['zero3']}", "--compile", "on,off"),
             "gpt2-124m, micro 32 x 1,024, bf16 weights (DeepSpeed's bf16 section) under ZeRO 0 and 3, compiled "
             "and eager, for their peaks"),
        Part("zero3_settings", 240, bench(out, "llama-1b-zero3", *llama, "--modes", "raw-compile,app", "--configs",
                                          ",".join(["zero3", *map(str, z3.values())]), "--profile", "zero3-stock"),
             "llama-1b as in llama_1b: ZeRO-3 as shipped, with DeepSpeed's defaults, with torch's linear "
             "(memory_efficient_linear false), with every parameter persistent and with DeepCompile: what each "
             "setting buys"),
        Part("offload", 240, bench(out, "llama-3b", "--model", "llama-3b", "--batch", 1, "--seq_len", 2048,
                                   "--ranks", 1, "--modes", "app", "--configs", "zero3_offload", "--steps", 2,
                                   "--warmup", 1),
             "llama-3b (Llama 3.2 3B's shape) fully fine-tuned under zero3_offload, micro 1 x 2,048: tokens/s, the "
             "GPU's and the host's peaks"),
        Part("sync_debug", 90, cuda_test("synchronises"),
             'the step under torch.cuda.set_sync_debug_mode("error"), ZeRO 0 and 2, eager and compiled'),
        Part("stock_steps", 60, cuda_test("stock_deepspeed_on_two_ranks"),
             "2 ranks sharing the GPU: skipped steps and the bf16 weights' step against stock DeepSpeed"),
        Part("losses_vs_stock", 90, cuda_test("losses_are_stock"),
             "the digits CNN, 20 steps: the app's losses against stock DeepSpeed's, ZeRO 1-3 and bf16 weights"),
        Part("plan_peak", 60, cuda_test("plan_predicts"), "the memory plan's peak against max_memory_allocated"),
        Part("preference", 150, cuda_test("preference"),
             "DPO in bf16 under ZeRO-3 on 2 ranks sharing the GPU, each reference; its host syncs counted"),
        Part("grpo_bench", 150, [sys.executable, "-m", "app.tools.bench_grpo", "--model", "gpt2-124m", "--prompts",
                                 "8", "--prompt_len", "128", "--num_generations", "8", "--max_completion_length",
                                 "128", "--steps", "3", "--output_dir", str(out / "grpo_bench")],
             "GRPO on gpt2-124m under ZeRO-3, 8 prompts x 8 completions of 128 tokens: sampled gathered whole and "
             "layer by layer against HF generate on the plain model; the step and its share spent sampling"),
        Part("grpo", 150, cuda_test("grpo"),
             "docs/rl.md's worked example in bf16 under ZeRO-3 on 2 ranks sharing the GPU: held-out reward before and "
             "after 60 steps"),
        Part("oom_snapshot", 120, [sys.executable, "scripts/oom_snapshot_check.py", str(out)],
             "gpt2-124m at a micro batch far too large: the one line names the memory snapshot, which loads; the "
             "step time with --memory_snapshot on against off"),
        Part("cuda_tests", 240, cuda_test("not synchronises and not stock_deepspeed_on_two_ranks and not "
                                          "losses_are_stock and not plan_predicts and not preference and not grpo and not "
                                          "long_sequence"),
             "the rest of tests/e2e/test_cuda.py"),
    ]


def cuda_available() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    return probe.stdout.strip() == "True"


def run_part(part: Part, out: Path, limit_s: float, cuda: bool) -> dict:
    """Run one part within limit_s seconds (its whole process group ended past it); what it gave."""
    log, figures_file = out / f"{part.name}.log", out / f"{part.name}.figures"
    if not cuda:
        log.write_text("needs a CUDA GPU\n")
        return {"status": "needs a CUDA GPU", "seconds": 0.0, "figures": {}}
    started = time.perf_counter()
    with open(log, "w") as sink:
        process = subprocess.Popen(part.command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", "GPU_CHECK_FIGURES": str(figures_file)},
                                   start_new_session=True)
        try:
            code = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            code = None
    text = log.read_text(errors="replace")
    status = "timed out" if code is None else "passed" if code == 0 else \
        "needs a CUDA GPU" if code == NEEDS_CUDA else f"failed (exit {code})"
    tests = outcomes(text)
    if status == "passed" and part.command[1:3] == ["-m", "pytest"] and not tests.get("PASSED"):
        status = "no test passed"
    return {"status": status, "seconds": round(time.perf_counter() - started, 1), "tests": tests,
            "figures": figures(text, figures_file), "tail": text.splitlines()[-15:] if status != "passed" else []}


def outcomes(text: str) -> dict:
    """pytest -v's outcome of each test in a log ({'PASSED': [...], 'FAILED': [...], ...}), so a part that ran
    out of time still tells which of its tests had passed."""
    found = {}
    for line in text.splitlines():
        name, _, outcome = line.partition(" ")
        if "::" in name and outcome.split(" ")[0] in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
            found.setdefault(outcome.split(" ")[0], []).append(name.split("::")[-1])
    return found


def figures(text: str, figures_file: Path) -> dict:
    """The figures a part's tests wrote (`name value` lines), and the benchmark's headlines, plan, profile and
    failure lines where it printed them, and the plan's recommendation."""
    found = {}
    for line in figures_file.read_text().splitlines() if figures_file.is_file() else []:
        name, _, value = line.partition(" ")
        found[name] = value
    found.update({line.split(":")[0]: line for line in text.splitlines()  # the benchmark's summary lines
                  if line.startswith(("headline", "plan ", "profile ", "failed ", "held ", "recommended"))})
    return found


def table(report: dict) -> str:
    rows = [f"{'part':<16} {'status':<28} {'seconds':>7}  figures"]
    for name, result in report["parts"].items():
        shown = "; ".join(f"{k} {v}" for k, v in result["figures"].items())
        counts = ", ".join(f"{len(v)} {k.lower()}" for k, v in result.get("tests", {}).items())
        shown = "; ".join(filter(None, [counts, shown]))
        rows.append(f"{name:<16} {result['status'][:28]:<28} {result['seconds']:>7}  {shown}")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--only", default="", help="comma-separated part names, run in that order (default: all)")
    parser.add_argument("--budget", type=float, default=540,
                        help="seconds for all parts together, and gpu_check.sh's install before them")
    parser.add_argument("--limit", action="append", default=[], metavar="NAME=SECONDS",
                        help="a part's own time limit instead of its default (repeatable)")
    args = parser.parse_args(argv)
    limits = dict(item.split("=", 1) for item in args.limit)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the budget counts from gpu_check.sh's start (GPU_CHECK_STARTED, seconds since the epoch): its install too
    started = time.perf_counter() - (time.time() - float(os.environ.get("GPU_CHECK_STARTED") or time.time()))
    cuda = cuda_available()
    report = {"cuda": cuda, "python": sys.version.split()[0], "versions": versions(), "parts": {}}
    named = {p.name: p for p in parts(out)}
    only = list(dict.fromkeys(name.strip() for name in args.only.split(",") if name.strip()))  # in order, once
    unknown = (set(limits) | set(only)) - set(named)
    if unknown:
        parser.error(f"--limit or --only names no part: {', '.join(sorted(unknown))}")
    chosen = [named[name] for name in only] if only else list(named.values())
    for part in chosen:
        left = args.budget - (time.perf_counter() - started)
        if left < 10:
            report["parts"][part.name] = {"status": "not run: no time left", "seconds": 0.0, "figures": {}}
            continue
        report["parts"][part.name] = {"what": part.what, **run_part(part, out, min(float(limits.get(part.name, part.limit_s)), left), cuda)}
        (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")  # each part kept as it ends
    report["seconds"] = round(time.perf_counter() - started, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    benches = [str(out / name) for name in BENCHES if (out / name / "bench-args.json").is_file()]
    if benches:  # the plan beside their peaks: CPU work, left for after the GPU's minutes
        print(f"the plan of the benchmarks' rows, on any machine: python -m app.tools.bench_replan {' '.join(benches)}")
    return 0 if all(r["status"] in ("passed", "needs a CUDA GPU") for r in report["parts"].values()) else 1


def versions() -> dict:
    """The versions the check ran on: torch, DeepSpeed, transformers, the GPU."""
    code = ("import json, torch, importlib.metadata as m\n"
            "v = {n: m.version(n) for n in ('torch', 'deepspeed', 'transformers', 'datasets', 'peft')\n"
            "     if next(m.distributions(name=n), None)}\n"
            "v['gpu'] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''\n"
            "print(json.dumps(v))")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return json.loads(probe.stdout) if probe.returncode == 0 else {"error": probe.stderr[-300:]}


if __name__ == "__main__":
    sys.exit(main())
