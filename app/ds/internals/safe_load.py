"""DeepSpeed's checkpoint files loaded as data, never as code.

They are pickles, and DeepSpeed 0.19.8 loads them with torch.load(weights_only=False) (its torch checkpoint
engine, zero_to_fp32, ds_to_universal, load_universal): a crafted file would run its code on every rank. Here every
load is forced to weights_only=True, with exactly the classes those files hold allowed besides tensors and plain
values (found with torch.serialization.get_unsafe_globals_in_checkpoint on every ds_configs/ file's checkpoints).
"""
import contextlib
import os
import pickle
import re
import zipfile
from pathlib import Path

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from app.errors import UserError

# ZeRO 1-3 optimizer files: the loss scaler object (Dynamic with fp16's dynamic scaling), the stage as an enum, and
# the fragment addresses of each parameter's slice; nothing else in them is more than tensors and plain values.
SAFE_GLOBALS = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch's switch: weights_only=True even where the caller says False


def refusal(error: Exception, path) -> UserError:
    """The one line for a checkpoint file that holds more than data (path: the file, or the folder it is in)."""
    found = re.search(r"GLOBAL (\S+)", str(error)) or re.search(r"(?:global|function|class) '?([\w.]+)", str(error))
    what = f" (it names {found.group(1)})" if found else ""
    return UserError(f"{path} is not a file of tensors and plain values{what}: a checkpoint file that can carry "
                     f"code is not loaded, and nothing of it ran; resume or export only checkpoints you made")


@contextlib.contextmanager
def data_only(where):
    """Every torch.load in the block loads data only (DeepSpeed's weights_only=False included), SAFE_GLOBALS
    allowed; a file that holds more ends the run in one line naming where."""
    before = os.environ.get(FORCE)
    os.environ[FORCE] = "1"
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            yield
    except pickle.UnpicklingError as e:
        raise refusal(e, where) from None
    finally:
        os.environ.pop(FORCE) if before is None else os.environ.__setitem__(FORCE, before)


def check_files(folder: Path):
    """Open every .pt file under folder as data only (memory-mapped: the tensors are not read); one line naming
    the first that holds more."""
    for path in sorted(Path(folder).rglob("*.pt")):
        with data_only(path):
            torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))  # legacy: no mmap


def enforce_in_this_process():
    """For a process that only loads checkpoints (the universal conversion): every load, in it and in the workers
    it forks, is data only."""
    os.environ[FORCE] = "1"
    torch.serialization.add_safe_globals(SAFE_GLOBALS)
