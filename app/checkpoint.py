"""Save, verify, resume and prune checkpoints; a checkpoint counts only once its manifest is written."""
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from app import distributed
from app.errors import UserError

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
LATEST = "latest_complete"


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


def save(engine, output_dir: Path, position: dict, record: dict, keep_last: int):
    """Every rank saves its shards and RNG state; rank 0 then seals the checkpoint with a manifest."""
    root = checkpoint_root(output_dir)
    tag = f"step{position['step']:08d}"
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    folder = root / tag
    (folder / f"rng_rank{distributed.rank():05d}.json").write_text(json.dumps(_rng_state()))
    distributed.barrier()  # every rank's files are on disk before the manifest vouches for them
    if distributed.is_main():
        (folder / STATE).write_text(json.dumps({**position, **record}, indent=2))
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
        manifest = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
        _atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1))
        _atomic_write(root / LATEST, tag)
        for old in complete_checkpoints(root)[:-keep_last] if keep_last else []:
            shutil.rmtree(old)
    distributed.barrier()


def complete_checkpoints(root: Path) -> list:
    """Checkpoint folders that have a manifest, oldest first."""
    return sorted(p.parent for p in Path(root).glob(f"step*/{MANIFEST}"))


def verify(folder: Path) -> dict:
    """The checkpoint's saved position and record, after checking every file against the manifest."""
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
    return json.loads((folder / STATE).read_text())


def find(output_dir: Path, resume: str):
    """The checkpoint folder to resume from, or None to start fresh ('auto' with nothing saved yet)."""
    if resume == "auto":
        found = complete_checkpoints(checkpoint_root(output_dir))
        return found[-1] if found else None
    folder = Path(resume)
    if not folder.is_dir():
        raise UserError(f"--resume {resume}: no such checkpoint folder; pass a folder under "
                        f"<output_dir>/checkpoints or --resume auto")
    return folder


def check_compatible(saved: dict, record: dict, folder: Path):
    """Refuse a checkpoint made for another model, dataset or ZeRO stage."""
    for key in ("model", "dataset", "zero_stage", "world_size"):
        if saved.get(key) != record.get(key):
            raise UserError(f"checkpoint {folder} was made with {key}={saved.get(key)!r} but this run has "
                            f"{key}={record.get(key)!r}; use the same settings or start a new --output_dir")


def load(engine, folder: Path, saved: dict) -> dict:
    """Restore engine, optimizer, scheduler and this rank's RNG; return the saved position."""
    path, _ = engine.load_checkpoint(str(folder.parent), tag=folder.name, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise UserError(f"DeepSpeed could not load {folder}; it may come from another world size or config")
    rng_file = folder / f"rng_rank{distributed.rank():05d}.json"
    if not rng_file.is_file():
        raise UserError(f"checkpoint {folder} was saved by {saved.get('world_size')} rank(s); resume it with the "
                        f"same number of ranks")
    _set_rng_state(json.loads(rng_file.read_text()))
    return saved
