"""DeepSpeed's private internals as the app uses them: the step's constants made without a copy from the host."""
import pytest
import torch

from app.ds.internals.device_constants import _ConstantsOnDevice, _constants_on_device, mask_not_finite


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


def test_the_mask_of_a_norm_that_is_not_finite_is_deepspeeds_bit_for_bit():
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    for values in ([1.5, float("inf")], [float("nan")], [-float("inf"), 0.0, 3.0], [2.0]):
        theirs, ours = torch.tensor(values), torch.tensor(values)
        mask_nan_or_inf_with_val_inplace(theirs, device="cpu")
        mask_not_finite(ours, device="cpu")
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (values, ours, theirs)


def test_a_wrapped_function_is_wrapped_once():
    def norm(x):
        return torch.tensor(-1.0, device=x.device)
    once = _constants_on_device(norm)
    assert _constants_on_device(once) is once and once.deepspeed_original is norm
    assert torch.equal(once(torch.zeros(1)), torch.tensor(-1.0))


def test_the_cpu_is_read_once_per_process_and_each_caller_gets_its_own_answer():
    """py-cpuinfo starts a Python process per question (about a second); DeepSpeed asks three times per CPU
    optimizer it builds. After cpu_info_once, the second question costs nothing and returns the same answer."""
    import time
    import cpuinfo
    from app.ds.internals import cpu_info_once
    cpu_info_once()
    cpu_info_once()  # patched once: the cache is not wrapped in another
    first = cpuinfo.get_cpu_info()
    first["flags"].append("changed by a caller")
    started = time.perf_counter()
    second = cpuinfo.get_cpu_info()
    assert time.perf_counter() - started < 0.05, "asked again"
    assert "changed by a caller" not in second["flags"] and second["arch"] == first["arch"]
    assert second == cpuinfo.get_cpu_info()
