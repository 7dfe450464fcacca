"""Save, verify, resume and prune checkpoints; a checkpoint counts only once its manifest is written."""
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from app import dist, ds_internals, faults
from app.errors import UserError

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
LATEST = "latest"
HF_FILES = "hf"  # config and tokenizer of a transformers model, for export in save_pretrained form
UNIVERSAL = "universal"  # world-size-independent copies made when a run resumes on another world size


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

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str, where) -> "TrainerState":
        """The state saved as text (in where), or one line saying what is missing."""
        saved = json.loads(text)
        missing = [f.name for f in fields(cls) if f.name not in saved and f.default is MISSING]
        if missing:
            raise UserError(f"{where} lacks {', '.join(missing)}: it was not written by this app; start a new run")
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})

    def at(self, step: int, epoch: int, batch: int) -> "TrainerState":
        """This run's record at a position of the loop."""
        return replace(self, step=step, epoch=epoch, batch=batch)

    def samples_into_epoch(self) -> int:
        """Samples of the epoch that every rank together had trained on when this was saved."""
        replicas = self.data_parallel_size or self.world_size
        return self.batch * self.deepspeed_config["train_micro_batch_size_per_gpu"] * replicas


def checkpoint_root(output_dir: Path) -> Path:
    """Where a run's checkpoints live."""
    return Path(output_dir) / "checkpoints"


def _atomic_write(path: Path, text: str):
    """Write text so that readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
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
            "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []}


def _set_rng_state(saved: dict):
    version, state, gauss = saved["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(saved["torch"], dtype=torch.uint8))
    if saved["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in saved["cuda"]])


def save(engine, output_dir: Path, state: TrainerState, keep_last: int, extra=None, every_rank=None):
    """Every rank saves its shards and RNG state (and runs every_rank(engine, folder), which may be a
    collective); rank 0 writes the state and extra(folder) files, then seals the folder with a manifest."""
    root = checkpoint_root(output_dir)
    tag = f"step{state.step:08d}"
    folder = root / tag
    if dist.is_main() and folder.exists():  # what a killed save of this step left behind
        shutil.rmtree(folder)
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    if every_rank is not None:
        every_rank(engine, folder)
    faults.kill_at("shards", state.step)
    (folder / f"rng_rank{dist.rank():05d}.json").write_text(json.dumps(_rng_state()))
    dist.barrier()  # every rank's files are on disk before the manifest vouches for them
    if dist.is_main():
        (folder / STATE).write_text(state.to_json())
        if extra is not None:
            extra(folder)
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
        manifest = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
        faults.kill_at("manifest", state.step)
        _atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1))
        faults.kill_at("pointer", state.step)
        _atomic_write(root / LATEST, tag)  # DeepSpeed's own tools read this; it only ever names a whole checkpoint
        for old in complete_checkpoints(root)[:-keep_last] if keep_last else []:
            shutil.rmtree(old)
            shutil.rmtree(root / UNIVERSAL / old.name, ignore_errors=True)
        for partial in root.glob("step*"):  # saves killed half-way at steps this run will not redo
            if not (partial / MANIFEST).is_file():
                shutil.rmtree(partial)
    dist.barrier()


def complete_checkpoints(root: Path) -> list:
    """Checkpoint folders that have a manifest, oldest first."""
    return sorted(p.parent for p in Path(root).glob(f"step*/{MANIFEST}"))


def verify(folder: Path) -> TrainerState:
    """The checkpoint's saved state, after checking every file against the manifest."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise UserError(f"{folder} is not a complete checkpoint (no {MANIFEST}); pass a checkpoint folder such as "
                        f"<output_dir>/checkpoints/step00000100, or --resume auto")
    manifest = json.loads(manifest_path.read_text())
    for name, expected in manifest.items():
        path = folder / name
        if not path.is_file():
            raise UserError(f"checkpoint {folder} is damaged: {name} is missing; resume from an older checkpoint")
        if path.stat().st_size != expected["size"] or _sha256(path) != expected["sha256"]:
            raise UserError(f"checkpoint {folder} is damaged: {name} does not match its manifest; "
                            f"resume from an older checkpoint")
    return TrainerState.from_json((folder / STATE).read_text(), folder / STATE)


def find(output_dir: Path, resume: str):
    """(folder, saved state) to resume from after checking every file, or (None, None) to start fresh."""
    if not resume:
        return None, None
    if resume == "auto":
        found = complete_checkpoints(checkpoint_root(output_dir))
        if not found:
            return None, None
        folder = found[-1]
    else:
        folder = Path(resume)
        if not folder.is_dir():
            raise UserError(f"--resume {resume}: no such checkpoint folder; pass a folder under "
                            f"<output_dir>/checkpoints or --resume auto")
    return folder, verify(folder)


def check_compatible(saved: TrainerState, current: TrainerState, folder: Path):
    """Refuse a checkpoint made for another model, dataset, ZeRO stage or pipeline split."""
    for key in ("model", "dataset", "zero_stage", "pipeline_stages", "tensor_parallel_size"):
        if getattr(saved, key) != getattr(current, key):
            raise UserError(f"checkpoint {folder} was made with {key}={getattr(saved, key)!r} but this run has "
                            f"{key}={getattr(current, key)!r}; use the same settings or start a new --output_dir")


def needs_universal(saved: TrainerState, world_size: int) -> bool:
    """ZeRO partitions optimizer state by world size: another world size needs a universal checkpoint."""
    return saved.zero_stage > 0 and saved.world_size != world_size


def plan_resume(output_dir: Path, resume: str, current: TrainerState, ds_config: dict) -> tuple:
    """(folder, saved state, DeepSpeed dict that can load it) to resume from, or (None, None, ds_config) to start
    fresh; checked against this run before anything is built."""
    folder, saved = find(output_dir, resume)
    if folder is None:
        if resume:
            dist.print0(f"resume: no complete checkpoint in {checkpoint_root(output_dir)}, starting fresh")
        return None, None, ds_config
    check_compatible(saved, current, folder)
    if (current.pipeline_stages or current.tensor_parallel_size > 1) and saved.world_size != current.world_size:
        kind = "pipeline" if current.pipeline_stages else "tensor-parallel"
        raise UserError(f"checkpoint {folder} is a {kind} run of {saved.world_size} rank(s) and the app cannot "
                        f"reshape its per-stage or per-shard state; resume it with {saved.world_size} rank(s)")
    if needs_universal(saved, current.world_size):
        dist.print0(f"resume: {folder} was saved by {saved.world_size} rank(s), this run has "
                    f"{current.world_size}: converting it to a universal checkpoint")
        folder = make_universal(folder, saved)
        ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
    return folder, saved, ds_config


def make_universal(folder: Path, saved: TrainerState) -> Path:
    """Convert a ZeRO checkpoint with DeepSpeed's ds_to_universal (once, on the main rank); return its folder."""
    target = folder.parent / UNIVERSAL / folder.name
    problem = ""
    if dist.is_main() and not (target / MANIFEST).is_file():
        shutil.rmtree(target, ignore_errors=True)
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(folder),
                   "--output_folder", str(target), "--inject_missing_state", "--num_extract_workers", "1",
                   "--num_merge_workers", "1"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode == 0:
            for name in (STATE, *(p.name for p in folder.glob("rng_rank*.json"))):
                shutil.copy(folder / name, target / name)
            _atomic_write(target / MANIFEST, "{}")  # marks the conversion as finished
        else:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            problem = (f"DeepSpeed cannot convert {folder} to another world size ({last}); "
                       f"resume it with {saved.world_size} rank(s)")
    problem = dist.broadcast_object(problem)
    if problem:
        raise UserError(problem)
    return target


def load(engine, folder: Path, saved: TrainerState, replicas: int) -> tuple:
    """Restore engine, optimizer, scheduler and RNG; return the (epoch, micro batch) this run continues from."""
    path, _ = engine.load_checkpoint(str(folder.parent), tag=folder.name, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise UserError(f"DeepSpeed could not load {folder}; it may come from another world size or config")
    ds_internals.replay_cpu_adam_steps(engine)
    rng_file = folder / f"rng_rank{dist.rank():05d}.json"
    if rng_file.is_file():  # absent for ranks that did not exist when it was saved: they keep the seed
        _set_rng_state(json.loads(rng_file.read_text()))
    samples, span = saved.samples_into_epoch(), engine.train_micro_batch_size_per_gpu() * replicas
    if samples % span:
        dist.print0(f"resume: {samples} samples into the epoch is not a whole number of global micro "
                    f"batches of {span}; repeating the last {samples % span}")
    dist.print0(f"resume: {folder} at step {saved.step}, epoch {saved.epoch}, batch {saved.batch}")
    return saved.epoch, samples // span
