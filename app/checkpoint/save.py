"""The trainer state and saving: every rank writes its shards, rank 0 seals the folder with a manifest (a checkpoint
counts only once it is written) and prunes old ones. app/checkpoint/resume.py finds, checks and restores them."""
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch

from app.checkpoint import disk
from app.distributed import dist
from app.ds import internals as ds_internals
from app.errors import UserError
from app.redact import redacted

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
LATEST = "latest"
BEST = "best"  # names the checkpoint --keep_best keeps
UNIVERSAL = "universal"  # world-size-independent copies made when a run resumes on another world size
RANK_FILES = "*_rank[0-9][0-9][0-9][0-9][0-9].*"  # each rank's own files (rng, a task's): <what>_rank<r:05d>.<ext>
SAVING = ".app-saving"  # in a checkpoint folder while the app writes it: the only folders a later save may clear
NAME = re.compile(r"step\d{8}")  # the app's checkpoint folders; anything else under checkpoints/ is the user's


@dataclass
class TrainerState:
    """What a checkpoint records besides DeepSpeed's shards: where the loop was, and the run that saved it."""
    step: int
    """Optimizer steps done."""
    epoch: int
    """The epoch to continue in."""
    batch: int
    """Micro batches of that epoch already done by each rank of the saving run."""
    model: str
    dataset: str
    world_size: int
    zero_stage: int
    settings: dict
    """The app's Settings of the saving run."""
    data_info: dict
    """The DataInfo the model was shaped for."""
    deepspeed_config: dict
    """The DeepSpeed dict the engine was built from, batch sizes resolved."""
    pipeline_stages: int = 0
    """Pipeline stages the model was split into (0: not split)."""
    data_parallel_size: int = 0
    """Replicas the data was sharded across (0, in older checkpoints: the world size)."""
    tensor_parallel_size: int = 1
    """Ranks each layer's matmuls were sharded across (DeepSpeed AutoTP)."""
    lora: dict = field(default_factory=dict)
    """LoRA runs: the adapters' rank, alpha, dropout and targets, and `base`, what identifies the frozen base model
    the checkpoint leaves out ({}: the whole model trains and is saved)."""
    task_record: dict = field(default_factory=dict)
    """What the task records of its settings, which a resume must match (app/core/task.py: record). Preference runs:
    the loss, beta, gamma, the reference and `base`, what identifies the model the reference is ({}: a task that
    records nothing; older checkpoints wrote it as `preference`)."""
    early_stopping: dict = field(default_factory=dict)
    """The evaluation early stopping and --keep_best watch, its best value and step, and the evaluations since
    that did not beat it (app/core/early_stop.py; {}: neither is on)."""

    def to_json(self) -> str:
        """The state as written: a secret in the DeepSpeed dict (a monitor's api_key) is kept out of the file."""
        return json.dumps(redacted(asdict(self)), indent=2)

    @classmethod
    def from_json(cls, text: str, where) -> "TrainerState":
        """The state saved as text (in where), or one line saying what is missing."""
        saved = json.loads(text)
        if not isinstance(saved, dict):
            raise UserError(f"{where} holds no trainer state: it was not written by this app; start a new run")
        if "preference" in saved:  # the record's name before every task had one
            saved["task_record"] = saved.pop("preference")
        missing = [f.name for f in fields(cls) if f.name not in saved and f.default is MISSING
                   and f.default_factory is MISSING]
        if missing:
            raise UserError(f"{where} lacks {', '.join(missing)}: it was not written by this app; start a new run")
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})

    def at(self, step: int, epoch: int, batch: int, **changed) -> "TrainerState":
        """This run's record at a position of the loop, with what changed since it was made (early_stopping)."""
        return replace(self, step=step, epoch=epoch, batch=batch, **changed)

    def samples_into_epoch(self) -> int:
        """Samples of the epoch that every rank together had trained on when this was saved."""
        replicas = self.data_parallel_size or self.world_size
        return self.batch * self.deepspeed_config["train_micro_batch_size_per_gpu"] * replicas


def checkpoint_root(output_dir: Path) -> Path:
    """Where a run's checkpoints live."""
    return Path(output_dir) / "checkpoints"


def atomic_write(path: Path, text: str):
    """Write text so that readers see the old file or the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # a new name: no planted link to follow
    with open(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync(path.parent)


def sync(path: Path):
    """Flush a file or a folder's entries to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _rng_state() -> dict:
    """This rank's python, numpy, torch and CUDA generator states as JSON-able values."""
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(state), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": torch.get_rng_state().tolist(),
            # the rank's own GPU only: a resume may see fewer GPUs (one per task under srun, a smaller node)
            "cuda": [torch.cuda.get_rng_state().tolist()] if torch.cuda.is_available() else []}


def set_rng_state(saved: dict):
    """This rank's generators as _rng_state() saved them."""
    version, state, gauss = saved["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(saved["torch"], dtype=torch.uint8))
    if saved["cuda"] and torch.cuda.is_available():  # the rank's own GPU's (checkpoints before held every GPU's)
        index = torch.cuda.current_device()
        own = saved["cuda"][index] if len(saved["cuda"]) > index else saved["cuda"][0]
        torch.cuda.set_rng_state(torch.tensor(own, dtype=torch.uint8))


def save_checkpoint(engine, output_dir: Path, state: TrainerState, keep_last: int, extra=None, every_rank=None,
                    kept: int = 0):
    """Every rank saves its shards and RNG state (and runs every_rank(engine, folder), which may be a
    collective); rank 0 writes the state and extra(folder) files, then seals the folder with a manifest, and
    prunes all but the newest keep_last checkpoints and step `kept`'s (--keep_best's, named in `best`).
    A save the disk has no room for is refused before it starts, and one that cannot be written ends the run
    in one line; either way the last complete checkpoint stays whole."""
    root = checkpoint_root(output_dir)
    folder = root / f"step{state.step:08d}"
    estimate = dist.host_sum([ds_internals.state_bytes(engine, dist.is_main())])[0]  # each rank's share of the save
    problem = ""
    if dist.is_main():
        try:
            problem = _before_save(root, folder, int(estimate))
        except OSError as e:
            problem = f"cannot save a checkpoint in {root}: {e}; fix the folder or pick another --output_dir"
        try:
            if not problem:
                _start(folder)
        except OSError as e:  # a read-only folder, say: every rank hears it here, none waits in the save
            problem = _cannot_write(root, e, estimate)
    problem = dist.broadcast_object(problem)
    if problem == "saved":  # resumed at this step and stopped before the next: the checkpoint is this state
        return
    if problem:
        raise UserError(problem)
    try:
        _write(engine, root, folder, state, extra, every_rank)
    except (OSError, RuntimeError) as e:
        if isinstance(e, torch.distributed.DistError):
            raise UserError(f"rank {dist.rank()}: another rank stopped while saving {folder} (its line says "
                            f"why)") from None
        raise UserError(_cannot_write(root, e, estimate)) from None
    if dist.is_main():
        for old in complete_checkpoints(root)[:-keep_last] if keep_last else []:
            if old.name != f"step{kept:08d}":
                remove_checkpoint(old)
        if (root / f"step{kept:08d}" / MANIFEST).is_file():
            atomic_write(root / BEST, f"step{kept:08d}")
    dist.barrier()


def _before_save(root: Path, folder: Path, estimate: int) -> str:
    """Rank 0 before a save: clear the app's unfinished saves, and say why the save cannot go ahead ('' if it
    can; 'saved' when this step's checkpoint is already whole)."""
    if folder.is_symlink() or folder.exists() and not folder.is_dir():
        return f"{folder} is not a folder this run wrote (a link or a file); move it away and resume"
    if (folder / MANIFEST).is_file():
        return "saved"
    for stale in unfinished_saves(root):
        shutil.rmtree(stale)  # saves killed half-way: room for this save
    done = complete_checkpoints(root)
    needed = disk.folder_bytes(done[-1]) if done else estimate  # the same tensors as last time
    return disk.shortfall(root, needed, done[-1].name if done else "")


def _start(folder: Path):
    """Rank 0: the save's folder, marked as the app's to clear while it is written."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SAVING).write_text(json.dumps({"pid": os.getpid()}))


def _cannot_write(root: Path, error: BaseException, estimate) -> str:
    """The line for a save the folder refused, with the size of the last whole checkpoint (else the estimate)."""
    done = complete_checkpoints(root)
    return disk.write_failure(root, error, disk.folder_bytes(done[-1]) if done else int(estimate),
                              done[-1].name if done else "")


def _write(engine, root: Path, folder: Path, state: TrainerState, extra, every_rank):
    """The save itself, in the folder rank 0 started: shards, RNG states, every file on the disk, then (rank 0)
    state, extra files, manifest and the latest pointer."""
    with ds_internals.config_saved_as(engine, redacted(engine.config)):  # its files keep a copy of the dict
        engine.save_checkpoint(str(root), tag=folder.name, save_latest=False,
                               exclude_frozen_parameters=has_frozen(engine))
    if every_rank is not None:
        every_rank(engine, folder)
    (folder / f"rng_rank{dist.rank():05d}.json").write_text(json.dumps(_rng_state()))
    for path in [*folder.rglob("*"), folder]:
        sync(path)  # a power cut after the manifest must not leave it vouching for files still in the cache
    dist.barrier()  # every rank's files are on disk before the manifest vouches for them
    if dist.is_main():
        (folder / STATE).write_text(state.to_json())
        if extra is not None:
            extra(folder)
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MANIFEST, SAVING))
        manifest = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256_of(p)} for p in files}
        atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1))
        (folder / SAVING).unlink()
        atomic_write(root / LATEST, folder.name)  # DeepSpeed's tools read this; it names only a whole checkpoint


def has_frozen(engine) -> bool:
    """Whether the model has frozen weights (LoRA's base model): checkpoints leave them out, resume builds them."""
    return any(not p.requires_grad for p in engine.module.parameters())


def complete_checkpoints(root: Path) -> list:
    """The app's checkpoint folders that have a manifest, oldest first."""
    return sorted(p.parent for p in Path(root).glob(f"step*/{MANIFEST}") if _ours(p.parent))


def unfinished_saves(root: Path) -> list:
    """The app's checkpoint folders whose save was cut short (marked, no manifest)."""
    return sorted(p.parent for p in Path(root).glob(f"step*/{SAVING}") if _ours(p.parent)
                  and not (p.parent / MANIFEST).exists())


def _ours(folder: Path) -> bool:
    return bool(NAME.fullmatch(folder.name)) and folder.is_dir() and not folder.is_symlink()


def remove_checkpoint(folder: Path):
    """Delete one of the app's checkpoints and its universal copy."""
    shutil.rmtree(folder)
    shutil.rmtree(folder.parent / UNIVERSAL / folder.name, ignore_errors=True)


def same_base(saved: str, now: str) -> bool:
    """Whether a checkpoint's base fingerprint is this run's; one that could not read a hub model's revision (None)
    holds its name alone."""
    return saved == now or (saved.endswith("(hub, revision None)") and now.startswith(saved.rsplit(" revision", 1)[0]))
