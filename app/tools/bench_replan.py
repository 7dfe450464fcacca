"""The memory plan of a benchmark's rows, made after it, on any machine: for a benchmark run with --plan off, or cut
short before it planned (the GPU check measures on the GPU and plans here, on a CPU).

    python -m app.tools.bench_replan OUTPUT_DIR [OUTPUT_DIR ...]

Each folder is a benchmark's --output_dir: its bench-args.json (the flags, the device, the configs) and the rows
its modes kept as they ended (rows-N-ranks.json). The plan lines are printed as the benchmark prints them, and
OUTPUT_DIR/plan.json holds each planned row's peaks.
"""
import argparse
import json
import sys
from pathlib import Path

from app.errors import UserError, report
from app.tools import bench
from app.tools.bench_modes import build_workload
from app.tools.bench_plan import add_planned_peaks

KEPT = ("mode", "ranks", "micro_batch", "compiled", "peak_memory_bytes", "host_peak_bytes", "plan_peak_bytes",
        "plan_over_peak", "plan_host_bytes")


def replan(folder: Path) -> list:
    """The plan lines of the rows in folder; writes folder/plan.json."""
    setup = folder / bench.SETUP
    if not setup.is_file():
        raise UserError(f"{folder} holds no {bench.SETUP}: name the --output_dir of a run of python -m app.tools.bench")
    saved = json.loads(setup.read_text())
    # the last --configs and --output_dir win over the other machine's paths (however abbreviated)
    args = bench.parse(saved["argv"] + ["--configs", "dp", "--output_dir", str(folder)])
    args.configs = saved["configs"]  # as the benchmark loaded them: their files may be on another machine
    rows = [row for path in sorted(folder.glob("rows-*-ranks.json")) for row in json.loads(path.read_text())
            if "failed" not in row]
    lines = add_planned_peaks(rows, args.configs, build_workload(args), saved["device"])
    planned = [{key: row.get(key) for key in KEPT} for row in rows if row["plan_peak_bytes"] is not None]
    (folder / "plan.json").write_text(json.dumps(planned, indent=1) + "\n")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.tools.bench_replan", description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="benchmark output folders")
    args = parser.parse_args(argv)
    try:
        for folder in args.folders:
            lines = replan(folder)
            print("\n".join([f"{folder}:", *lines] if lines else [f"{folder}: no app row the plan covers"]))
    except UserError as e:
        return report(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
