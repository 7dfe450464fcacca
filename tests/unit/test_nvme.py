"""Offload to NVMe checked before any engine: the folders each section names made and written, one line where one
cannot be; nothing asked of a config that offloads elsewhere. A run that offloads there: tests/e2e/test_nvme.py."""
import json

import pytest

from app.errors import UserError
from app.memory import nvme
from conftest import REPO


def _offloading(optimizer: dict, param: dict = None) -> dict:
    zero = {"stage": 3, "offload_optimizer": optimizer, **({"offload_param": param} if param else {})}
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}


def test_only_the_sections_that_offload_to_nvme_under_zero3_are_named():
    ds = _offloading({"device": "nvme", "nvme_path": "/a"}, {"device": "cpu"})
    assert nvme.folders(ds) == {"offload_optimizer": "/a"}
    zero2 = {**ds, "zero_optimization": {**ds["zero_optimization"], "stage": 2}}  # DeepSpeed's CPU offload there
    assert nvme.folders(zero2) == {}
    nvme.check({**zero2, "train_micro_batch_size_per_gpu": "auto"}, "c.json")
    assert nvme.folders(json.loads((REPO / "ds_configs" / "zero3_offload.json").read_text())) == {}
    nvme.check(json.loads((REPO / "ds_configs" / "zero3_offload.json").read_text()), "zero3_offload.json")


BUILDABLE = pytest.mark.skipif(not nvme.async_io_buildable(), reason=f"the folders are checked once the async_io op "
                               f"can be built: {nvme.LIBAIO}, which `sudo make cluster-packages` installs")


@BUILDABLE
def test_a_missing_folder_is_made_and_written_where_deepspeed_would_make_it(tmp_path):
    swap = tmp_path / "nvme" / "swap"
    nvme.check(_offloading({"device": "nvme", "nvme_path": str(swap)}, {"device": "nvme", "nvme_path": str(swap)}),
               "c.json")
    assert swap.is_dir() and not list(swap.iterdir()), "made, and the probe it wrote is gone"


@pytest.mark.parametrize("path, says", [
    (None, "c.json: zero_optimization.offload_param offloads to NVMe and gives no nvme_path: set "
           "zero_optimization.offload_param.nvme_path to a folder on a local NVMe drive"),
    ("a-file/swap", "c.json: zero_optimization.offload_param.nvme_path {tmp}/a-file/swap cannot be written here "
                    "([Errno 20] Not a directory: "),
])
@BUILDABLE
def test_a_folder_that_cannot_be_written_is_one_line(tmp_path, path, says):
    (tmp_path / "a-file").write_text("not a folder")
    param = {"device": "nvme", **({"nvme_path": str(tmp_path / path)} if path else {})}
    with pytest.raises(UserError) as refused:
        nvme.check(_offloading({"device": "cpu"}, param), "c.json")
    assert str(refused.value).startswith(says.format(tmp=tmp_path)) and (tmp_path / "a-file").read_text() == \
        "not a folder"


def test_the_async_io_check_answers_the_same_where_stderr_has_no_descriptor(capsys):
    """DeepSpeed's check sends the compiler's errors to a file through sys.stderr's descriptor; a notebook's (or
    pytest's captured) stderr has none, which it would count as no libaio."""
    import io
    import contextlib
    import shutil
    from pathlib import Path
    libaio = Path("/usr/include/libaio.h").is_file() and shutil.which("cc") is not None
    with contextlib.redirect_stderr(io.StringIO()):
        assert nvme.async_io_buildable() == libaio
    assert nvme.async_io_buildable() == libaio


def test_an_auto_micro_batch_with_offload_to_nvme_is_one_line(tmp_path):
    """Each trial engine of the search pins its own NVMe swap buffers, which DeepSpeed does not give back (2 ranks of
    gpt2-tiny grew past 12 GB each and the kernel killed one): a number is asked for instead."""
    ds = {**_offloading({"device": "nvme", "nvme_path": str(tmp_path)}), "train_micro_batch_size_per_gpu": "auto"}
    with pytest.raises(UserError, match="with offload to NVMe, give train_micro_batch_size_per_gpu a number"):
        nvme.check({**ds, "zero_optimization": {**ds["zero_optimization"], "offload_optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path / "swap")}}}, "c.json")
    assert not (tmp_path / "swap").exists(), "refused before any folder is made"
    nvme.check({**ds, "zero_optimization": {"stage": 3}}, "c.json")
