"""Disk space for checkpoints: what a save needs, what is free, and a write that failed said in one line."""
import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path

# A write that ran out of room, however the writer words it (torch's zip writer and C++ streams do not say).
FULL = (errno.ENOSPC, errno.EDQUOT)
CUT_SHORT = ("unexpected pos", "iostream error", "file write failed", "No space left")


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under folder."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def free_bytes(path: Path) -> int:
    """Bytes free to this user on the filesystem that holds path (or would, for a path not made yet)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _mb(count: float) -> str:
    return f"{count / 2**20:,.1f} MB"


def shortfall(root: Path, needed: int, last: str) -> str:
    """'' when the filesystem of root has room for a checkpoint of `needed` bytes, else the line that says not."""
    free = free_bytes(root)
    if free >= needed:
        return ""
    return (f"not enough space to save a checkpoint in {root}: it needs about {_mb(needed)} and {_mb(free)} are "
            f"free; {_what_now(last)}")


def write_failure(root: Path, error: BaseException, needed: int, last: str) -> str:
    """The line for a save that could not be written: a full disk or quota, a read-only folder, or another
    refusal of the filesystem, with the space needed and free."""
    code = getattr(error, "errno", None) or _refusal(root)  # a writer that does not say why: ask the folder
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if code in FULL or any(part in text for part in CUT_SHORT):
        why = "the disk (or the quota) is full"
    elif code is not None:
        why = os.strerror(code).lower()
    else:
        why = text
    return (f"cannot save a checkpoint in {root}: {why} (it needs about {_mb(needed)}, {_mb(free_bytes(root))} "
            f"free); {_what_now(last)}")


def _refusal(root: Path):
    """The errno with which the filesystem refuses a new file in root (read-only, permissions, full), or None."""
    probe = None
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=root)  # a new name: no planted link to follow
        with open(fd, "wb") as f:
            f.write(b"\0" * 4096)
        os.unlink(probe)
    except OSError as e:
        with contextlib.suppress(OSError, TypeError):
            os.unlink(probe)
        return e.errno
    return None


def _what_now(last: str) -> str:
    kept = f"the last complete checkpoint, {last}, is whole: continue from it with --resume auto" if last else \
        "no checkpoint of this run was saved yet: run the same command again"
    return f"free some space, lower --keep_last or pick an --output_dir with room; {kept}"
