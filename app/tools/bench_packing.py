"""Packed against padded on the same instruction data: the same training command run twice, rows padded to the
longest (--packing off) and packed into blocks (--packing on), and the rows and real (not padding) tokens each
trains per second, with their ratio.

    python -m app.tools.bench_packing --model runs/opposites/model --dataset runs/opposites/chats.jsonl \\
        [--steps 30] [--launcher "deepspeed --num_gpus 2"] [--output_dir runs/bench-packing] [-- more train.py flags]

Each run's rates: samples per second, the median of its steps after the first (whose compile and warm-up differ
between the two shapes; evaluation and saving are not counted), from metrics.csv, times the rows and real tokens a
sample holds on average over the training set, from summary.json. Writes report.json in --output_dir.
"""
import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from app.observe.runlog import read_rows

REPO = Path(__file__).resolve().parents[2]
MODES = {"padded": "off", "packed": "on"}


def command_start(launcher: str) -> list:
    """A training command up to its flags: the launcher (default: this python) and app/train.py."""
    start = shlex.split(launcher) if launcher else [sys.executable]
    beside = Path(sys.executable).parent / start[0]  # a launcher of this environment's, not on PATH
    start[0] = start[0] if shutil.which(start[0]) or not beside.is_file() else str(beside)
    return start + [str(REPO / "app" / "train.py")]


def command(launcher: str, mode: str, args, extra: list) -> list:
    """The training command of one mode."""
    return command_start(launcher) + ["--model", args.model, "--dataset", args.dataset,
                    "--max_steps", str(args.steps), "--log_interval", "1", "--eval_answers", "0",
                    "--packing", MODES[mode], "--overwrite", "--output_dir", str(Path(args.output_dir) / mode), *extra]


def rates(summary: dict, rows: list) -> dict:
    """The run's rates over its steps after the first (rows: metrics.csv's training rows, one a step)."""
    timed = [row["samples_per_s"] for row in rows if row.get("samples_per_s") is not None][1:]
    samples = statistics.median(timed)
    per = {key: summary[key] / summary["samples_per_s"] for key in ("rows_per_s", "real_tokens_per_s")}
    return {"samples_per_s": samples, **{key: samples * share for key, share in per.items()},
            "train_s": summary["train_s"], "steps": len(timed)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.tools.bench_packing", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", required=True, help="instruction data: rows of messages, or prompt/completion")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of each run (default: 30)")
    parser.add_argument("--launcher", default="", help='e.g. "deepspeed --num_gpus 2" (default: one process)')
    parser.add_argument("--output_dir", default="runs/bench-packing")
    args, extra = parser.parse_known_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2: a run's first step (its compile, its warm-up) is not timed")
    extra = [a for a in extra if a != "--"]
    found = {}
    for mode in MODES:
        done = subprocess.run(command(args.launcher, mode, args, extra), capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            errors = [line for line in (done.stdout + done.stderr).splitlines() if "error:" in line]
            print(f"error: the {mode} run failed (exit {done.returncode}): "
                  f"{errors[-1] if errors else (done.stdout + done.stderr)[-2000:]}")
            return done.returncode
        run = Path(args.output_dir) / mode
        found[mode] = rates(json.loads((run / "summary.json").read_text()), read_rows(run / "metrics.csv"))
    for mode, row in found.items():
        print(f"{mode:7} {row['samples_per_s']:9.2f} samples/s {row['rows_per_s']:9.2f} rows/s "
              f"{row['real_tokens_per_s']:11.1f} real tokens/s (median of {row['steps']} steps, the first left out)")
    ratio = found["packed"]["real_tokens_per_s"] / found["padded"]["real_tokens_per_s"]
    print(f"packed / padded: {ratio:.2f}x the real tokens per second")
    report = {**found, "packed_over_padded": ratio, "model": args.model, "dataset": args.dataset,
              "launcher": args.launcher or "python", "extra": extra}
    (Path(args.output_dir) / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
