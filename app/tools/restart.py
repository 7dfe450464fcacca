"""Run a training command again after a crash, from its last checkpoint: what torchrun --max_restarts does, for any
launcher (the deepspeed launcher has no such option).

    python -m app.tools.restart --max_restarts 2 -- deepspeed app/train.py --deepspeed_config ds_configs/zero2.json \\
        --output_dir runs/a --save_interval 100

A command that ends with a code other than 0 (done, or stopped on request) and 2 (a user's error, which running
again would not cure) is run again, up to --max_restarts times: with --resume auto once it has saved a checkpoint in
--output_dir, so the run continues from its newest; before that, as it was given (its own --resume, a checkpoint of
another run, still the one to start from), with --overwrite for what the crashed attempt left there. Each attempt
sees APP_RESTART_COUNT (0, 1, ...). SIGTERM, SIGINT or SIGUSR1 to the tool go on to the run, which saves and stops,
and nothing is run after it.
"""
import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from app.checkpoint.save import MANIFEST, checkpoint_root, complete_checkpoints
from app.errors import UserError, report

USER_ERROR = 2


def parse(argv=None):
    """(max restarts, seconds to wait, the command); a command without --output_dir is a UserError."""
    parser = argparse.ArgumentParser(prog="python -m app.tools.restart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_restarts", type=int, default=3, help="runs after the first (default: %(default)s)")
    parser.add_argument("--wait", type=float, default=5.0,
                        help="seconds between an exit and the next run, for ports and devices to free up")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UserError("give the training command after --, e.g. -- deepspeed app/train.py --output_dir runs/a")
    if not any(a == "--output_dir" or a.startswith("--output_dir=") for a in command):
        raise UserError("the command needs --output_dir: a restarted run continues from the checkpoints there")
    if args.max_restarts < 0 or args.wait < 0:
        raise UserError("--max_restarts and --wait must be 0 or more")
    return args.max_restarts, args.wait, command


def with_resume(command: list) -> list:
    """command continuing from its last checkpoint: --resume auto in place of any other --resume."""
    kept, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            kept.append(arg)
    return [*kept, "--resume", "auto"]


def checkpoints(command: list) -> set:
    """(name, manifest's mtime) of each complete checkpoint in the command's --output_dir."""
    at = next(i for i, a in enumerate(command) if a == "--output_dir" or a.startswith("--output_dir="))
    output_dir = command[at].partition("=")[2] or (command[at + 1] if at + 1 < len(command) else "")
    return {(folder.name, (folder / MANIFEST).stat().st_mtime_ns)
            for folder in complete_checkpoints(checkpoint_root(Path(output_dir)))}


def _forwarding() -> dict:
    """{"run": the command's process, "asked": whether this tool was asked to stop}: SIGTERM, SIGINT and SIGUSR1 to
    the tool go on to the run (which saves and stops), and no run starts after it, as torchrun's agent does."""
    state = {"run": None, "asked": False}

    def forward(signum, frame):
        state["asked"] = True
        if state["run"] is not None and state["run"].poll() is None:
            state["run"].send_signal(signum)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, forward)
    return state


def main(argv=None) -> int:
    """Run the command, again after each crash; the last run's exit code."""
    try:
        max_restarts, wait, command = parse(argv)
    except UserError as e:
        return report(e)
    before, run = checkpoints(command), command  # before: another run's, or a timeline the command drops
    stopping = _forwarding()
    for attempt in range(max_restarts + 1):
        stopping["run"] = subprocess.Popen(run, env={**os.environ, "APP_RESTART_COUNT": str(attempt)})
        code = stopping["run"].wait()
        if code in (0, USER_ERROR) or attempt == max_restarts or stopping["asked"]:
            return code
        saved = bool(checkpoints(command) - before)
        # not saved: as it was given, over what the crashed run left (its metrics.csv would be another run's)
        run = with_resume(command) if saved else [*command, *(["--overwrite"] if "--overwrite" not in command else [])]
        print(f"restart: the run exited with {code}; running it again from "
              f"{'its last checkpoint' if saved else 'where it started (it saved no checkpoint)'} "
              f"({attempt + 1} of {max_restarts} restarts) in {wait:g} s", flush=True)
        time.sleep(wait)
    return code


if __name__ == "__main__":
    sys.exit(main())
