"""Where a run of the suite spent its time, split by what the tests must do for real (docs/tests.md, "How long it
takes"), from pytest's junit file and the TEST_LAUNCH_LOG file of the same run:

    TEST_LAUNCH_LOG=/tmp/launch.log .venv/bin/python -m pytest -q tests --junitxml=/tmp/junit.xml
    python tests/helpers/suite_time.py /tmp/junit.xml /tmp/launch.log
"""
import collections
import json
import sys
import xml.etree.ElementTree as ElementTree

LAUNCHERS = ("/deepspeed ", "/torchrun ", "sbatch ", "app.tools.restart")
TOOLS = ("app.tools.bench ", "app.tools.bench_packing ")
WORKED_EXAMPLE = "--max_steps 60 --eval_interval 15"  # tests/e2e/test_instruction.py's learnt_job


def kind(command: str) -> str:
    """What a logged command is, or "" for the rest (shared launches are counted by their jobs)."""
    if command.startswith("job"):
        if "--compile on" in command:
            return "compiled jobs of shared launches"
        return "the worked example of instruction tuning" if WORKED_EXAMPLE in command else ""
    if any(name in command for name in LAUNCHERS):
        return "runs through a real launcher (deepspeed, torchrun, Slurm, the restart tool)"
    if any(name in command for name in TOOLS):
        return "the benchmark tools' own runs"
    return "compiled single-process runs" if "--compile on" in command else ""


def main(junit: str, launch_log: str):
    cases = list(ElementTree.parse(junit).getroot().iter("testcase"))
    total = sum(float(case.get("time")) for case in cases)
    unit = sum(float(case.get("time")) for case in cases if ".unit." in case.get("classname"))
    seconds, count = collections.Counter(), collections.Counter()
    for line in open(launch_log):
        row = json.loads(line)
        command = row["command"] if isinstance(row["command"], str) else " ".join(map(str, row["command"]))
        name = kind(command)
        if name:
            seconds[name] += row["seconds"]
            count[name] += 1
    print(f"{total:8.1f} s  {len(cases)} tests (the unit tier: {unit:.1f} s)")
    for name, spent in seconds.most_common():
        print(f"{spent:8.1f} s  {count[name]:3d} {name}")
    print(f"{total - sum(seconds.values()):8.1f} s  the rest")


if __name__ == "__main__":
    main(*sys.argv[1:])
