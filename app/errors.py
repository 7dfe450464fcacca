"""The one exception type that means 'the user asked for something we cannot do', and how entry points say it."""
import os
import sys
import time
from pathlib import Path


class UserError(Exception):
    """A mistake in the user's input: reported as one line on stderr, never as a traceback."""


class RankAlone(UserError):
    """A failure only this rank knows of, the other ranks blocked where it left them: said at once, since they
    will not get to say it, after which the launcher ends them."""


class SaidByAnotherRank(UserError):
    """This rank ends because another one left with a line of its own (RankAlone): nothing more to say."""


def report(error: Exception) -> int:
    """Say `error: <what to fix>` in one line on stderr and return the exit code 2.

    In a multi-rank job rank 0 speaks first; the other ranks speak only if the launcher has not
    ended them by then (it does once rank 0 exits), so one mistake is one line, not one per rank.
    A rank that leaves alone (RankAlone) speaks at once; one that another's leaving ended says nothing.
    """
    rank, alone = int(os.environ.get("RANK", "0")), isinstance(error, RankAlone)
    if isinstance(error, SaidByAnotherRank):
        return 2
    # a DataLoader worker's error comes back wrapped in its traceback: its last line is the one that matters
    error = (str(error).strip().splitlines() or [""])[-1].removeprefix(f"{UserError.__module__}.UserError: ")
    if rank != 0:
        if not alone:
            time.sleep(3)
        print(f"[rank {rank}] error: {error}", file=sys.stderr, flush=True)
    else:
        print(f"error: {error}", file=sys.stderr, flush=True)
    return 2


def first_line(error: Exception) -> str:
    """The first line of the innermost cause, where libraries wrap the real complaint."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def deepspeed_failure(error: Exception, when: str) -> "UserError | None":
    """The one line for an error DeepSpeed raised from its own code (the innermost frame is DeepSpeed's) while
    building the engine or stepping: a feature of the JSON that this model or machine does not suit, which the
    user changes in the JSON; None for an error from elsewhere (the app's own are bugs, with a traceback)."""
    import traceback
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or "/deepspeed/" not in frames[-1].filename:
        return None
    where = frames[-1].filename.split("/deepspeed/")[-1]
    return UserError(f"DeepSpeed failed {when} ({type(error).__name__}: {first_line(error)}, in deepspeed/{where}:"
                     f"{frames[-1].lineno}): a section of the DeepSpeed config this model or machine does not suit; "
                     f"remove it or try it on the hardware it was written for")


def folder_files(folder, patterns) -> str:
    """The files of folder that match patterns, for a line naming what could not be read: folder/name, or
    folder (name, name), or the folder alone when none is there."""
    found = sorted({p.name for pattern in patterns for p in Path(folder).glob(pattern)})
    if len(found) == 1:
        return str(Path(folder) / found[0])
    return f"{folder} ({', '.join(found)})" if found else str(folder)

