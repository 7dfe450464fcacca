"""ZeRO-Infinity's offload to NVMe ("device": "nvme"), checked on every rank before any engine: each folder the
config names can be written on this machine, and DeepSpeed's async_io op, which builds against libaio, can be
built here. Either failing inside DeepSpeed is a traceback deep in its swapper, or minutes into the op's build."""
import contextlib
import tempfile
from pathlib import Path

from app.errors import UserError, first_line

SECTIONS = ("offload_optimizer", "offload_param")
LIBAIO = "libaio (apt-get install libaio-dev; dnf install libaio-devel)"


def folders(ds: dict) -> dict:
    """{section: its nvme_path (None: not given)} of each zero_optimization section that offloads to NVMe."""
    zero = ds.get("zero_optimization") or {}
    return {section: zero[section].get("nvme_path") for section in SECTIONS
            if isinstance(zero.get(section), dict) and zero[section].get("device") == "nvme"}


def check(ds: dict, where: str):
    """One line for an NVMe offload this machine cannot run, or with a micro batch "auto" (its search's trial
    engines would each pin swap buffers that stay pinned); each folder made where it is missing (as DeepSpeed
    would make it)."""
    named = folders(ds)
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
    if named and ds.get("train_micro_batch_size_per_gpu") == "auto":
        raise UserError(f"{where}: with offload to NVMe, give train_micro_batch_size_per_gpu a number: \"auto\" "
                        f"tries sizes on trial engines, and the host memory DeepSpeed pins for each one's NVMe swap "
                        f"buffers is not given back (python -m app.tools.plan says which micro batch fits)")
    if named and not async_io_buildable():
        raise UserError(f"{where}: offload to NVMe needs DeepSpeed's async_io op, which builds against {LIBAIO}, "
                        f"missing here: install it, or offload to \"cpu\"")


def async_io_buildable() -> bool:
    """Whether DeepSpeed's async_io op can be built (or is) on this machine's accelerator. DeepSpeed's check links a
    test program against libaio with its errors sent to a file through sys.stderr's descriptor, and counts a
    sys.stderr without one (a notebook's, a captured one) as no libaio: it gets a file of its own."""
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    with tempfile.TemporaryFile("w") as sink, contextlib.redirect_stderr(sink):
        return builder is not None and builder.is_compatible(verbose=False)
