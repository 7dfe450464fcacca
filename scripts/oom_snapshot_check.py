"""The GPU check's oom_snapshot part (scripts/gpu_check.py): a real out-of-memory in a real run on the GPU writes a
memory snapshot that the run's one line names; and what recording (--memory_snapshot on, the default) costs a step.

    python3 scripts/oom_snapshot_check.py OUT_DIR

Three runs of app/train.py, one process each, gpt2-124m on 1,024-token blocks of generated text, eager:
1. a micro batch of 512 (far more activations than a GPU holds): it must exit non-zero with one error line that names
   <output_dir>/memory/rank0.oom.pickle, a pickle with 'segments' and 'device_traces' that holds the out-of-memory
   and the app's own Python frames;
2. and 3. a micro batch of 8, 20 steps, with --memory_snapshot on and off: the median step time of steps 6-20 of
   each (eager steps allocate more often than compiled ones), and no snapshot written.
The figures go to GPU_CHECK_FIGURES (a `name value` line each) and are printed. Exit 0 when every check held, 1 when
one did not (a line says which), 77 without a CUDA GPU.
"""
import csv
import json
import os
import pickle
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NEEDS_CUDA = 77
OOM_MICRO, TIMED_MICRO, STEPS, SETTLED = 512, 8, 20, 5  # the first SETTLED steps are left out of the step time
LINE = re.compile(r"memory snapshot: (\S+) \(open it in https://pytorch\.org/memory_viz\)")


def corpus(path: Path, rows: int = 40000) -> Path:
    """Generated sentences, 25 bytes each: with the byte tokenizer about 950 training blocks of 1,024 tokens."""
    pick = random.Random(0).choice
    animals, verbs = ["cat", "dog", "bird", "fish", "horse", "cow", "goat", "owl"], ["sees", "likes", "chases"]
    path.write_text("".join(f"the {pick(animals)} {pick(verbs)} the {pick(animals)} .\n" for _ in range(rows)))
    return path


def config(path: Path, micro: int) -> Path:
    """ds_configs/dp.json at a fixed micro batch, bf16 autocast set (the memory plan does not weigh it)."""
    ds = json.loads((REPO / "ds_configs" / "dp.json").read_text())
    ds.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=1)
    ds["torch_autocast"] = {**ds["torch_autocast"], "enabled": True}
    path.write_text(json.dumps(ds, indent=1) + "\n")
    return path


def train(out: Path, name: str, data: Path, micro: int, *argv) -> subprocess.CompletedProcess:
    """python app/train.py, one process, gpt2-124m on data at micro, its output in out/name."""
    command = [sys.executable, "app/train.py", "--model", "gpt2-124m", "--dataset", str(data), "--block_size", "1024",
               "--deepspeed_config", str(config(out / f"{name}.json", micro)), "--compile", "off",
               "--eval_fraction", "0.02", "--output_dir", str(out / name), *map(str, argv)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    (out / f"{name}.log").write_text(f"$ {' '.join(command)}\nexit {result.returncode}\n{result.stdout}\n"
                                     f"{result.stderr}")
    return result


def frames_of(snapshot: dict) -> list:
    """Every frame recorded in the snapshot: its blocks' and its traces'."""
    blocks = [b for segment in snapshot["segments"] for b in segment.get("blocks", [])]
    traces = [entry for trace in snapshot["device_traces"] for entry in trace]
    return [f for item in blocks + traces for f in item.get("frames", [])]


def the_oom(out: Path, data: Path, figures: dict) -> list:
    """The out-of-memory run; what did not hold."""
    result = train(out, "oom", data, OOM_MICRO, "--max_steps", 2)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    named = LINE.search(errors[0]) if len(errors) == 1 else None
    figures.update(oom_exit=result.returncode, oom_error_lines=len(errors))
    failed = [f"the run exited {result.returncode}"] if result.returncode in (0, None) else []
    if not (len(errors) == 1 and "ran out of memory" in errors[0] and named) or "Traceback" in result.stderr:
        return failed + [f"not one error line naming a snapshot: {errors or result.stderr[-1000:]}"]
    path = REPO / named.group(1)
    if path != out / "oom" / "memory" / "rank0.oom.pickle" or not path.is_file():
        return failed + [f"the line names {path}, which is not the run's memory/rank0.oom.pickle or not there"]
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    actions = [entry.get("action") for trace in snapshot.get("device_traces", []) for entry in trace]
    frames = frames_of(snapshot) if "segments" in snapshot else []
    figures.update(snapshot_mb=round(path.stat().st_size / 1e6, 2), snapshot_segments=len(snapshot["segments"]),
                   snapshot_trace_entries=len(actions), snapshot_has_oom=int("oom" in actions),
                   snapshot_names_app_frames=int(any(f.get("filename", "").startswith(f"{REPO / 'app'}/")
                                                     for f in frames)))
    if not ({"segments", "device_traces"} <= set(snapshot) and "oom" in actions and figures[
            "snapshot_names_app_frames"]):
        failed.append(f"the snapshot lacks its segments, its traces, the out-of-memory or the app's frames "
                      f"(keys {sorted(snapshot)}, {len(actions)} trace entries)")
    return failed


def step_ms(run: Path) -> float:
    """The median milliseconds of the run's optimizer steps after the first SETTLED (metrics.csv, a row a step)."""
    with open(run / "metrics.csv") as f:
        rates = [float(r["samples_per_s"]) for r in csv.DictReader(f) if r["loss"] and r["samples_per_s"]]
    return 1000 * TIMED_MICRO / statistics.median(rates[SETTLED:])


def the_cost(out: Path, data: Path, figures: dict) -> list:
    """Step times with recording on and off; what did not hold."""
    failed = []
    for choice in ("on", "off"):
        name = f"record_{choice}"
        result = train(out, name, data, TIMED_MICRO, "--max_steps", STEPS, "--log_interval", 1,
                       "--memory_snapshot", choice)
        if result.returncode != 0:
            failed.append(f"the {choice} run exited {result.returncode}: {result.stderr[-1000:]}")
            continue
        figures[f"step_ms_{choice}"] = round(step_ms(out / name), 2)
        if (out / name / "memory").exists():
            failed.append(f"the {choice} run, which did not run out of memory, wrote {out / name / 'memory'}")
    if not failed:
        figures["step_on_over_off"] = round(figures["step_ms_on"] / figures["step_ms_off"], 3)
    return failed


def main(out_dir: str) -> int:
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != "True":
        print("needs a CUDA GPU")
        return NEEDS_CUDA
    out = Path(out_dir).resolve() / "oom_snapshot"
    out.mkdir(parents=True, exist_ok=True)
    data, figures = corpus(out / "corpus.txt"), {}
    failed = the_oom(out, data, figures) + the_cost(out, data, figures)
    lines = [f"{name} {value}" for name, value in figures.items()]
    if os.environ.get("GPU_CHECK_FIGURES"):
        with open(os.environ["GPU_CHECK_FIGURES"], "a") as f:
            f.write("".join(line + "\n" for line in lines))
    print("\n".join([*lines, *(f"failed: {why}" for why in failed)]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
