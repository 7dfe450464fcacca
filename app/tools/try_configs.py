"""Try DeepSpeed config files as a new user would: each trains a few steps of the default job on this machine,
one after another, and each outcome is counted: trained, refused in one line (which line), or a traceback.

    python -m app.tools.try_configs <file or folder> [...] [--steps 3] [--output_dir runs/try-configs]

Writes report.json (one row per file) in --output_dir and prints a line per file and the counts.
"""
import argparse
import collections
import json
import subprocess
import sys
from pathlib import Path

from app.ds import accelerate_file

REPO = Path(__file__).resolve().parents[2]


def files_of(paths: list) -> list:
    """The .json (and .conf, a name some projects give theirs) files and accelerate config files (.yaml, .yml)
    named or in the folders named, sorted."""
    kinds, found = (".json", ".conf", *accelerate_file.SUFFIXES), []
    for path in map(Path, paths):
        found += sorted(p for p in path.iterdir() if p.suffix.lower() in kinds) if path.is_dir() else [path]
    return found


def outcome(output: str, code: int) -> tuple:
    """(kind, the error line or '') of one run's output and exit code."""
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    if code == 0:
        return "trained", ""
    if "Traceback" in output:
        return "traceback", (output.strip().splitlines() or [""])[-1]
    return ("one line" if len(errors) == 1 else f"exit {code}"), (errors[0] if errors else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.tools.try_configs", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="DeepSpeed JSON files or accelerate config files, or folders of "
                        "them")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per file (default: 3)")
    parser.add_argument("--output_dir", default="runs/try-configs", help="where each run and report.json go")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1 (got {args.steps}): each file trains that many optimizer steps")
    out, rows = Path(args.output_dir), []
    out.mkdir(parents=True, exist_ok=True)
    for path in files_of(args.paths):
        done = subprocess.run([sys.executable, str(REPO / "app" / "train.py"), "--deepspeed_config", str(path),
                               "--max_steps", str(args.steps), "--output_dir", str(out / path.stem), "--overwrite"],
                              capture_output=True, text=True, cwd=REPO)
        kind, line = outcome(done.stdout + done.stderr, done.returncode)
        rows.append({"file": str(path), "kind": kind, "line": line})
        print(f"{kind:9} {path.name}{'  ' + line if line else ''}", flush=True)
    (out / "report.json").write_text(json.dumps(rows, indent=1) + "\n")
    counts = collections.Counter(row["kind"] for row in rows)
    print(f"{len(rows)} file(s): " + ", ".join(f"{n} {kind}" for kind, n in counts.most_common()))
    return 1 if counts.get("traceback") else 0


if __name__ == "__main__":
    sys.exit(main())
