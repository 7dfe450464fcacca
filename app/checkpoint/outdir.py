"""The run folder: one run at a time in it (a lock rank 0 holds), one timeline of checkpoints, and what --overwrite
removes. Only what the app wrote is ever removed; anything else in the folder is the user's."""
import errno
import fcntl
import json
import os
import re
import socket
import tempfile
import time
from pathlib import Path

from app.distributed import dist
from app.checkpoint.save import (BEST, LATEST, UNIVERSAL, atomic_write, checkpoint_root, complete_checkpoints,
                                 remove_checkpoint, unfinished_saves)

LOCK = ".app-lock"
RUN_FILES = ("metrics.csv", "summary.json", "loss.png")
_held = {}  # lock path -> its open file: the lock lasts while the file is open, and ends with the process


def default_name(dataset: str, model: str) -> str:
    """runs/<dataset>-<model>-<time>, from the last part of each name only, so it stays inside runs/."""
    def plain(name):
        return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name.rstrip("/")).name).lstrip(".") or "x"
    return f"runs/{plain(dataset)}-{plain(model)}-{time.strftime('%Y%m%d-%H%M%S')}"


def check(path: Path, overwrite: bool, resume: bool = False) -> str:
    """Why path cannot take this run's files, or '' when it can (creates it if missing)."""
    existing = earlier_run(path) if path.is_dir() else []
    if existing and not (overwrite or resume):
        return (f"output directory {path} already holds a run ({', '.join(existing)}); "
                f"pick a new --output_dir, --resume auto to continue it, or --overwrite to delete it")
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.unlink(tempfile.mkstemp(prefix=".write-test-", dir=path)[1])  # a new name: no planted link to follow
    except OSError as e:
        return f"cannot write to output directory {path}: {e.strerror}; pick a writable --output_dir"
    return ""


def lock(output_dir: Path) -> tuple:
    """Take output_dir's lock for this process: (problem, note): the line naming the run that holds it, or a
    note when a killed run's lock was taken over."""
    path = Path(output_dir) / LOCK
    while True:
        try:
            handle = open(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), "r+")
        except OSError as e:
            return f"cannot lock output directory {output_dir}: {path} {e.strerror}; remove it", ""
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(handle.read())
            handle.close()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return (f"output directory {output_dir} is in use by another run ({holder}); wait for it to end, "
                        f"or pick another --output_dir"), ""
            return "", f"note: cannot lock {output_dir} ({e.strerror}): nothing stops a second run from using it"
        if os.path.samestat(os.fstat(handle.fileno()), os.stat(path, follow_symlinks=False)):
            break
        handle.close()  # the run before removed the file as we opened it: lock the new one
    left = handle.read()
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    handle.flush()
    _held[str(path)] = handle
    return "", f"note: took over the lock of a run that ended without releasing it ({_holder(left)})" if left else ""


def _holder(text: str) -> str:
    try:
        found = json.loads(text)
        return f"host {found['host']}, pid {found['pid']}"
    except (ValueError, KeyError, TypeError):
        return "unknown"


def unlock():
    """Release every lock this process holds (removing its file)."""
    for path, handle in list(_held.items()):
        os.unlink(path)  # still held: no other run can have locked this file meanwhile
        handle.close()
        del _held[path]


def earlier_run(output_dir: Path) -> list:
    """What an earlier run left in output_dir that the app wrote: run files, tensorboard, checkpoints."""
    root = checkpoint_root(output_dir)
    found = [name for name in RUN_FILES if (Path(output_dir) / name).is_file()]
    found += ["tensorboard"] if any((Path(output_dir) / "tensorboard").glob("events.out.tfevents.*")) else []
    done = complete_checkpoints(root)  # a save cut short alone is no run: the next save clears it
    return found + ([f"{len(done)} checkpoint(s)"] if done else [])


def check_timeline(output_dir: Path, folder, overwrite: bool) -> str:
    """Why resuming folder into output_dir would mix two timelines of checkpoints ('' if it would not)."""
    if folder is None or overwrite:
        return ""
    root = checkpoint_root(output_dir)
    if Path(folder).parent.resolve() == root.resolve():
        later = [p.name for p in complete_checkpoints(root) if p.name > Path(folder).name]
        if later:
            return (f"resuming {Path(folder).name} in {output_dir} would leave {', '.join(later)} of the same run "
                    f"beside the new ones; --resume auto continues from the newest, --overwrite deletes them")
        return ""
    found = earlier_run(output_dir)
    if found:
        return (f"output directory {output_dir} already holds another run ({', '.join(found)}); resume {folder} "
                f"into a new --output_dir, or pass --overwrite to delete that run")
    return ""


def clear(output_dir: Path, folder, overwrite: bool):
    """With --overwrite, delete (saying what) the app's files that are not this run's timeline: the earlier run's,
    or checkpoints after the one resumed in place."""
    if not overwrite or not dist.is_main():
        return
    root, output_dir = checkpoint_root(output_dir), Path(output_dir)
    if folder is not None and Path(folder).parent.name == UNIVERSAL:  # the copy made for another world size
        folder = Path(folder).parent.parent / Path(folder).name
    in_place = folder is not None and Path(folder).parent.resolve() == root.resolve()
    checkpoints = [p for p in complete_checkpoints(root) + unfinished_saves(root)
                   if not in_place or p.name > Path(folder).name]
    files = [] if in_place else [output_dir / name for name in RUN_FILES if (output_dir / name).is_file()] + \
        sorted((output_dir / "tensorboard").glob("events.out.tfevents.*")) + \
        sorted((output_dir / "answers").glob("step*.jsonl"))
    if not checkpoints and not files:
        return
    for path in files:
        path.unlink()
    for path in checkpoints:
        remove_checkpoint(path)
    kept = complete_checkpoints(root)
    if kept:
        atomic_write(root / LATEST, kept[-1].name)
    elif (root / LATEST).is_file():
        (root / LATEST).unlink()
    if (root / BEST).is_file() and (root / BEST).read_text().strip() not in [p.name for p in kept]:
        (root / BEST).unlink()  # --keep_best's pointer at a checkpoint just deleted
    if not in_place and (root / UNIVERSAL).is_dir() and not any((root / UNIVERSAL).iterdir()):
        (root / UNIVERSAL).rmdir()
    names = [p.name for p in files[:4]] + [p.name for p in checkpoints]
    dist.print0(f"overwrite: deleted {len(files) + len(checkpoints)} file(s) and folder(s) of the earlier "
                f"{'timeline' if in_place else 'run'} in {output_dir}: {', '.join(names)}")
