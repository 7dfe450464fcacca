"""Run a training command again after a crash, from its last checkpoint: what torchrun --max_restarts does, for any
launcher (the deepspeed launcher has no such option).

    python -m app.tools.restart --max_restarts 2 -- deepspeed app/train.py --deepspeed_config ds_configs/zero2.json \\
        --output_dir runs/a --save_interval 100

A command that ends with a code other than 0 (done, or stopped on request) and 2 (a user's error, which running
again would not cure) is run again with --resume auto, up to --max_restarts times; the run continues from its
newest complete checkpoint in --output_dir. Each attempt sees APP_RESTART_COUNT (0, 1, ...).
"""
import argparse
import os
import subprocess
import sys
import time

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


def main(argv=None) -> int:
    """Run the command, again after each crash; the last run's exit code."""
    try:
        max_restarts, wait, command = parse(argv)
    except UserError as e:
        return report(e)
    for attempt in range(max_restarts + 1):
        run = command if attempt == 0 else with_resume(command)
        code = subprocess.run(run, env={**os.environ, "APP_RESTART_COUNT": str(attempt)}).returncode
        if code in (0, USER_ERROR) or attempt == max_restarts:
            return code
        print(f"restart: the run exited with {code}; running it again from its last checkpoint "
              f"({attempt + 1} of {max_restarts} restarts) in {wait:g} s", flush=True)
        time.sleep(wait)
    return code


if __name__ == "__main__":
    sys.exit(main())
