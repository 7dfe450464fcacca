"""DeepSpeed's memory-efficient linear in F.linear's place and out of it (app/ds/internals/linear.py)."""
import inspect

import pytest
import torch.nn.functional as F
from deepspeed.runtime.zero import partition_parameters
from deepspeed.runtime.zero.linear import zero3_linear_wrap

from app.ds import internals as ds_internals


def test_torch_linear_comes_back_after_deepspeeds_memory_efficient_one():
    """zero.Init swaps F.linear for DeepSpeed's for the rest of the process, keeping torch's as `linear_bk`; the
    benchmark's next mode gets torch's back."""
    patcher = partition_parameters.InsertPostInitMethodToModuleSubClasses
    swap = inspect.getsource(partition_parameters.Init._enable_mem_efficient_linear)
    assert "linear_bk = torch.nn.functional.linear" in swap and "functional.linear = zero3_linear_wrap" in swap
    torchs = F.linear
    if not hasattr(patcher, "linear_bk"):  # the swap as DeepSpeed makes it (its method prints through dist)
        patcher.linear_bk = F.linear
    F.linear = partition_parameters.zero3_linear_wrap
    ds_internals.restore_torch_linear()
    assert F.linear is torchs


def test_deepspeeds_linear_is_in_place_inside_and_torchs_after_even_an_error():
    torchs = F.linear
    with pytest.raises(RuntimeError, match="inside"):
        with ds_internals.deepspeed_linear():
            assert F.linear is zero3_linear_wrap
            raise RuntimeError("inside")
    assert F.linear is torchs
