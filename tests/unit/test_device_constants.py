"""The constants of DeepSpeed's step made on the device (app/ds/internals/device_constants.py): the same tensors."""
import inspect

import pytest
import torch

from app.ds.internals.device_constants import (_ConstantsOnDevice, _constants_on_device, constants_on_device,
                                               mask_not_finite)


class Spy(torch.overrides.TorchFunctionMode):
    """Records the torch functions named in `watched` that reach it."""

    def __init__(self, watched):
        super().__init__()
        self.watched, self.seen = watched, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.watched:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("data, kwargs", [(-1.0, {"dtype": torch.float}), (-1.0, {}), ([2.5], {}), ([1.0], {}),
                                          (3, {}), ([0, 0], {"dtype": torch.int64}), (True, {}),
                                          (0.1, {"dtype": torch.bfloat16}), (1.0, {"requires_grad": True})])
def test_constants_made_on_the_device_equal_those_copied_from_the_host(data, kwargs):
    copied = torch.tensor(data, device="cpu", **kwargs)
    with _ConstantsOnDevice():
        made = torch.tensor(data, device="cpu", **kwargs)
    assert made.dtype == copied.dtype and made.shape == copied.shape and torch.equal(made, copied)
    assert made.requires_grad == copied.requires_grad


def test_only_python_values_bound_for_a_device_are_made_there():
    spy = Spy({"full", "tensor"})
    with spy, _ConstantsOnDevice():
        torch.tensor(-1.0, device="cpu")
        torch.tensor([1.0, 2.0], device="cpu")  # not one value repeated: copied as before
        torch.tensor(-1.0)  # no device: a host tensor, nothing to copy
    assert spy.seen == ["full", "tensor", "tensor"]


def test_a_zero_host_tensor_sent_to_a_device_is_made_there_and_any_other_is_copied():
    zero, value, large = torch.Tensor([0.0, 0.0]), torch.tensor([0.0, 1.0]), torch.zeros(65)
    spy = Spy({"to", "zeros"})
    with spy, _ConstantsOnDevice():
        made = zero.to("meta")
        value.to("meta")  # holds a value: copied
        large.to("meta")  # larger than any of DeepSpeed's constants
        zero.to("cpu")  # stays on the host: nothing to copy
    assert spy.seen == ["zeros", "to", "to", "to"]
    assert made.device.type == "meta" and made.shape == (2,) and made.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_mask_of_a_norm_that_is_not_finite_is_deepspeeds_bit_for_bit(dtype):
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    for values in ([1.5, float("inf")], [float("nan")], [-float("inf"), 0.0, 3.0], [2.0], 7.0, float("nan")):
        theirs, ours = torch.tensor(values, dtype=dtype), torch.tensor(values, dtype=dtype)
        mask_nan_or_inf_with_val_inplace(theirs, device="cpu")
        mask_not_finite(ours, device="cpu")
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (values, ours, theirs)


def test_a_wrapped_function_is_wrapped_once():
    def norm(x):
        return torch.tensor(-1.0, device=x.device)
    once = _constants_on_device(norm)
    assert _constants_on_device(once) is once and once.deepspeed_original is norm
    assert torch.equal(once(torch.zeros(1)), torch.tensor(-1.0))


def test_the_patches_land_where_deepspeeds_step_looks_them_up_and_are_installed_once(monkeypatch):
    """DeepSpeed's ZeRO modules call the mask by its module-level name, so replacing that name is what changes their
    step; a name DeepSpeed no longer has would be set silently and change nothing."""
    from deepspeed.runtime import engine as ds_engine
    from deepspeed.runtime.pipe import engine as pipe_engine
    from deepspeed.runtime.zero import stage3, stage_1_and_2
    wrapped = [(stage3.DeepSpeedZeroOptimizer_Stage3, "get_grad_norm_direct"), (ds_engine, "clip_grad_norm_"),
               (pipe_engine.PipelineEngine, "_aggregate_total_loss")]
    originals = [getattr(owner, name) for owner, name in wrapped]
    for owner, name in [(stage_1_and_2, "mask_nan_or_inf_with_val_inplace"),
                        (stage3, "mask_nan_or_inf_with_val_inplace"), *wrapped]:
        monkeypatch.setattr(owner, name, getattr(owner, name))  # fails on a name DeepSpeed dropped; undone after
    for module in (stage_1_and_2, stage3):
        assert "mask_nan_or_inf_with_val_inplace(total_norm" in inspect.getsource(module)
    assert "clip_grad_norm_(parameters=self.module.parameters()" in \
        inspect.getsource(ds_engine.DeepSpeedEngine.clip_fp32_gradients)
    constants_on_device()
    constants_on_device()
    assert stage_1_and_2.mask_nan_or_inf_with_val_inplace is mask_not_finite
    assert stage3.mask_nan_or_inf_with_val_inplace is mask_not_finite
    for (owner, name), original in zip(wrapped, originals):
        assert getattr(owner, name).deepspeed_original is original, f"{name} wrapped twice"
