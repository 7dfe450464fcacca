"""DeepSpeed's private internals as the app uses them: the step's constants made without a copy from the host."""
import pytest
import torch

from app.ds.internals.host_waits import _ConstantsOnDevice, _constants_on_device


@pytest.mark.parametrize("data, kwargs", [(-1.0, {"dtype": torch.float}), (-1.0, {}), ([2.5], {}), ([1.0], {}),
                                          (3, {}), ([0, 0], {"dtype": torch.int64}), (True, {})])
def test_constants_made_on_the_device_equal_those_copied_from_the_host(data, kwargs):
    copied = torch.tensor(data, device="cpu", **kwargs)
    with _ConstantsOnDevice():
        made = torch.tensor(data, device="cpu", **kwargs)
    assert made.dtype == copied.dtype and made.shape == copied.shape and torch.equal(made, copied)


def test_only_python_values_bound_for_a_device_are_made_there():
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))
    with Spy(), _ConstantsOnDevice():
        torch.tensor(-1.0, device="cpu")
        torch.tensor([1.0, 2.0], device="cpu")  # not one value repeated: copied as before
        torch.tensor(-1.0)  # no device: a host tensor, nothing to copy
    assert seen == ["full", "tensor", "tensor"]


def test_a_wrapped_function_is_wrapped_once():
    def norm(x):
        return torch.tensor(-1.0, device=x.device)
    once = _constants_on_device(norm)
    assert _constants_on_device(once) is once and once.deepspeed_original is norm
    assert torch.equal(once(torch.zeros(1)), torch.tensor(-1.0))
