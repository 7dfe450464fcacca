"""The quarantine of DeepSpeed's internals (app/ds/internals/__init__.py): what it exports, the DeepSpeed it is for."""
import re

import deepspeed

from app.ds import internals as ds_internals
from conftest import REPO


def test_every_internal_the_app_calls_is_exported_by_the_package():
    """A name missing from the package fails only when the path that calls it runs (a pipeline, a resume)."""
    used = {name for path in (REPO / "app").rglob("*.py")
            for name in re.findall(r"\bds_internals\.(\w+)", path.read_text())}
    assert used, "no use of ds_internals found"
    assert sorted(used - set(ds_internals.__all__)) == []
    assert [name for name in ds_internals.__all__ if not hasattr(ds_internals, name)] == []


def test_the_package_is_written_for_the_deepspeed_that_requirements_txt_pins():
    pinned = re.search(r"^deepspeed==(\S+)$", (REPO / "requirements.txt").read_text(), re.M).group(1)
    assert ds_internals.WRITTEN_FOR == pinned


def test_the_version_note_is_silent_on_that_version_and_names_both_versions_on_another():
    note = ds_internals.version_note()
    if deepspeed.__version__ == ds_internals.WRITTEN_FOR:
        assert note == ""
    else:
        assert note.startswith(f"warning: DeepSpeed {deepspeed.__version__} is installed")
        assert f"install deepspeed=={ds_internals.WRITTEN_FOR}" in note and "\n" not in note


def test_torch_linear_comes_back_after_deepspeeds_memory_efficient_one():
    """zero.Init swaps F.linear for DeepSpeed's for the rest of the process, keeping torch's as `linear_bk`; the
    benchmark's next mode gets torch's back."""
    import inspect
    import torch.nn.functional as F
    from deepspeed.runtime.zero import partition_parameters
    patcher = partition_parameters.InsertPostInitMethodToModuleSubClasses
    swap = inspect.getsource(partition_parameters.Init._enable_mem_efficient_linear)
    assert "linear_bk = torch.nn.functional.linear" in swap and "functional.linear = zero3_linear_wrap" in swap
    torchs = F.linear
    if not hasattr(patcher, "linear_bk"):  # the swap as DeepSpeed makes it (its method prints through dist)
        patcher.linear_bk = F.linear
    F.linear = partition_parameters.zero3_linear_wrap
    ds_internals.restore_torch_linear()
    assert F.linear is torchs
