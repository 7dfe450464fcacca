"""ZeRO-Infinity's offload to NVMe ("device": "nvme" under ZeRO-3), checked on every rank before any engine: the
micro batch is a number, DeepSpeed's async_io op, which builds against libaio, can be built here, and each folder
the config names can be written on this machine. Each failing inside DeepSpeed is a traceback deep in its
swapper, minutes into the op's build, or host memory the micro batch search's trial engines keep pinned."""
import contextlib
import sys
import tempfile
from pathlib import Path

from app.ds.config import zero_stage
from app.errors import UserError, first_line

SECTIONS = ("offload_optimizer", "offload_param")
LIBAIO = "libaio (apt-get install libaio-dev; dnf install libaio-devel)"


def folders(ds: dict) -> dict:
    """{section: its nvme_path (None: not given)} of each zero_optimization section that offloads to NVMe; ZeRO 1-2
    take NVMe for the CPU (DeepSpeed's CPU offload), and nothing there goes to a drive."""
    zero = ds.get("zero_optimization") or {}
    if zero_stage(ds) != 3:
        return {}
    return {section: zero[section].get("nvme_path") for section in SECTIONS
            if isinstance(zero.get(section), dict) and zero[section].get("device") == "nvme"}


def check(ds: dict, where: str):
    """One line for an NVMe offload this machine cannot run, or with a micro batch "auto" (its search's trial
    engines would each pin swap buffers that stay pinned); each folder made where it is missing (as DeepSpeed
    would make it), once the rest has passed."""
    named = folders(ds)
    if not named:
        return
    if ds.get("train_micro_batch_size_per_gpu") == "auto":
        raise UserError(f"{where}: with offload to NVMe, give train_micro_batch_size_per_gpu a number: \"auto\" "
                        f"tries sizes on trial engines, and the host memory DeepSpeed pins for each one's NVMe swap "
                        f"buffers is not given back (python -m app.tools.plan says which micro batch fits)")
    if not async_io_buildable():
        raise UserError(f"{where}: offload to NVMe needs DeepSpeed's async_io op, which builds against {LIBAIO}, "
                        f"missing here: install it, or offload to \"cpu\"")
    for section, folder in named.items():
        key = f"zero_optimization.{section}.nvme_path"
        if not folder:
            raise UserError(f"{where}: zero_optimization.{section} offloads to NVMe and gives no nvme_path: set "
                            f"{key} to a folder on a local NVMe drive")
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as e:
            raise UserError(f"{where}: {key} {folder} cannot be written here ({first_line(e)}): give a folder on a "
                            f"local NVMe drive that this user can write") from None


def async_io_buildable() -> bool:
    """Whether DeepSpeed's async_io op was built with DeepSpeed or can be built here. DeepSpeed's probe links a test
    program against libaio, the compiler's complaints sent to a file through sys.stderr's descriptor: it is given
    the process's own (fd 2), not a captured or a notebook's stderr, which has none (counted as no libaio) or
    another (the compiler's complaints printed)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    if installed_ops.get("async_io"):
        return True
    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    with contextlib.redirect_stderr(sys.__stderr__ or sys.stderr):
        return builder is not None and builder.is_compatible(verbose=False)
