"""The one exception type that means 'the user asked for something we cannot do', and how entry points say it."""
import os
import re
import sys
from pathlib import Path


class UserError(Exception):
    """A mistake in the user's input: one line on stderr, never a traceback. Every rank raises it; rank 0 says it."""


class Ended(Exception):
    """This rank ends on a failure that is not a user's mistake: `alone`, only this rank knows it and says it at once
    (the others are blocked where it left them, and the launcher ends them); else another rank has said it."""

    def __init__(self, why: str = "", alone: bool = False):
        super().__init__(why)
        self.alone = alone


def report(error: Exception) -> int:
    """Say `error: <what to fix>` in one line on stderr where it is this rank's to say; the exit code 2.

    A user's mistake is rank 0's to say (every rank found it, or was told it by rank 0); a rank that ends alone
    says its own line, naming itself; a rank that another rank's line ended says nothing.
    """
    rank = int(os.environ.get("RANK", "0"))
    if isinstance(error, Ended) and not error.alone or not isinstance(error, Ended) and rank != 0:
        return 2
    # a DataLoader worker's error comes back wrapped in its traceback: its last line is the one that matters
    error = (str(error).strip().splitlines() or [""])[-1].removeprefix(f"{UserError.__module__}.UserError: ")
    print(f"{f'[rank {rank}] ' if rank else ''}error: {error}", file=sys.stderr, flush=True)
    return 2


def first_line(error: Exception) -> str:
    """The first line of the innermost cause, where libraries wrap the real complaint."""
    seen = {id(error)}
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        error = inner
        seen.add(id(error))
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


def one_value_per_channel(error: Exception) -> "UserError | None":
    """The one line for BatchNorm's refusal to train on one value per channel (a micro batch of one sample whose
    feature maps have shrunk to 1x1), which the user fixes in the DeepSpeed config; None for any other error."""
    text = first_line(error)
    if "more than 1 value per channel when training" not in text:
        return None
    size = next(iter(re.findall(r"torch\.Size\((\[[^\]]*\])\)", text)), "one sample")
    return UserError(f"a BatchNorm layer cannot train on one value per channel (its input is {size}): a micro batch "
                     f"of 1 sample is too small for this model at this image size; set "
                     f"train_micro_batch_size_per_gpu to 2 or more in the DeepSpeed config")


def folder_files(folder, patterns) -> str:
    """The files of folder that match patterns, for a line naming what could not be read: folder/name, or
    folder (name, name), or the folder alone when none is there."""
    found = sorted({p.name for pattern in patterns for p in Path(folder).glob(pattern)})
    if len(found) == 1:
        return str(Path(folder) / found[0])
    return f"{folder} ({', '.join(found)})" if found else str(folder)

