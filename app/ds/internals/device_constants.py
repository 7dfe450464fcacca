"""DeepSpeed's step without the host waits CUDA would make in it: constants copied from the host, and stream
synchronizations where the device already orders the work.

On a GPU the host queues the step and runs ahead; each of these makes it wait for the device. A CPU run skips
DeepSpeed's CUDA-only branches, so tests/helpers/host_syncs.py counts them from the guard DeepSpeed puts before each.
"""
import sys

import torch
from torch.overrides import TorchFunctionMode


def _repeated_number(data) -> tuple:
    """(value, shape) when data is a Python number or a flat list of one number repeated, else (None, None)."""
    if isinstance(data, (bool, int, float)):
        return data, ()
    if isinstance(data, (list, tuple)) and data and all(type(v) in (int, float) and v == data[0] for v in data):
        return data[0], (len(data),)
    return None, None


class _ConstantsOnDevice(TorchFunctionMode):
    """`torch.tensor(-1.0, device=d)` becomes `torch.full((), -1.0, device=d)`: the same tensor, made by a fill
    kernel on the device instead of a blocking copy from the host; a zero CPU tensor sent to the device
    (`torch.Tensor([0.0, 0.0]).to(d)`) becomes zeros made there."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "tensor" and kwargs.get("device") is not None:
            value, shape = _repeated_number(args[0] if args else kwargs.get("data"))
            if value is not None:
                return torch.full(shape, value, dtype=kwargs.get("dtype"), device=kwargs["device"],
                                  requires_grad=kwargs.get("requires_grad", False))
        if name == "to" and len(args) == 2 and isinstance(args[0], torch.Tensor) and not kwargs and \
                isinstance(args[1], (str, torch.device)) and args[0].device.type == "cpu" and \
                torch.device(args[1]).type != "cpu" and args[0].numel() <= 64 and not args[0].any():
            return torch.zeros(args[0].shape, dtype=args[0].dtype, device=args[1])
        return func(*args, **kwargs)


def _constants_on_device(function):
    if hasattr(function, "deepspeed_original"):
        return function

    def without_copies(*args, **kwargs):
        with _ConstantsOnDevice():
            return function(*args, **kwargs)
    without_copies.deepspeed_original = function
    return without_copies


# DeepSpeed's functions that synchronize a stream or the device behind `if not resolves_data_dependency()`, by
# code object: {code: on_device(locals) -> True when the device orders the work by itself (having queued any
# wait it needs), False when the host must still wait}.
_ON_DEVICE = {}


def _install_guard():
    """Answer "the device resolves it" at the guards of _ON_DEVICE that can do without the host; else as before."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    asked = accelerator.resolves_data_dependency
    if getattr(asked, "deepspeed_original", None) is not None:
        return

    def resolves_data_dependency():
        caller = sys._getframe(1)
        on_device = _ON_DEVICE.get(caller.f_code)
        return True if on_device is not None and on_device(caller.f_locals) else asked()
    resolves_data_dependency.deepspeed_original = asked
    accelerator.resolves_data_dependency = resolves_data_dependency


def _offloaded(tensor) -> bool:
    """Whether tensor (a ZeRO-3 partition) is kept off the device the rank computes on."""
    from deepspeed.accelerator import get_accelerator
    return tensor is not None and tensor.device.type != torch.device(get_accelerator().current_device_name()).type


def _code(method):
    """The code object of method, under DeepSpeed's NVTX decorator (which keeps no __wrapped__) if any."""
    cells = [cell.cell_contents for cell in method.__closure__ or ()] if method.__name__ == "wrapped_fn" else []
    return next((inner for inner in cells if callable(inner)), method).__code__


def _compute_waits_for_reduction(optimizer) -> bool:
    """ZeRO-3's end of backward: the compute stream waits on the device for the reduction stream, where the host
    waited for it; not with an offloaded optimizer, whose CPU Adam reads the gradients on the host."""
    from deepspeed.accelerator import get_accelerator
    if optimizer.offload_optimizer:
        return False
    stream, current = optimizer.reduce_and_partition_stream, get_accelerator().current_stream()
    if stream is not None and current is not None and stream != current:
        current.wait_stream(stream)
    return True


def _zero3_waits():
    """ZeRO-3's waits that the device orders by itself, unless parameters are offloaded (then the host must know
    a copy from its memory finished before it changes that memory)."""
    from deepspeed.runtime.zero import partition_parameters as pp
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    # a parameter "gathered" on one rank is its own partition, on the device already: the copy is a view
    _ON_DEVICE[_code(pp.NoGatherHandle.wait)] = lambda f: not _offloaded(f["self"]._NoGatherHandle__param.ds_tensor)
    _ON_DEVICE[_code(pp.NoGatherCoalescedHandle.wait)] = \
        lambda f: not any(_offloaded(p.ds_tensor) for p in f["self"]._NoGatherCoalescedHandle__params)
    # persistent parameters gathered after each step: the collective's wait has ordered the stream already
    for method in (pp.Init._allgather_params_coalesced, pp.Init._allgather_params_sequential):
        _ON_DEVICE[_code(method)] = lambda f: not any(_offloaded(p.ds_tensor) for p in f["param_list"])
    _ON_DEVICE[_code(DeepSpeedZeroOptimizer_Stage3.independent_gradient_partition_epilogue)] = \
        lambda f: _compute_waits_for_reduction(f["self"])


def step_without_host_waits(engine):
    """Route DeepSpeed's step around its host waits: the norm's and the clip's constants made on the device
    (ZeRO 1-3, and DeepSpeed's own clip on pipelines and tensor parallelism), a pipeline stage's loss buffer
    made there, and ZeRO-3's stream synchronizations left to the device."""
    from deepspeed.runtime import engine as ds_engine
    from deepspeed.runtime.pipe import engine as pipe_engine
    from deepspeed.runtime.zero import stage3, stage_1_and_2
    for module in (stage_1_and_2, stage3):
        module.mask_nan_or_inf_with_val_inplace = _constants_on_device(module.mask_nan_or_inf_with_val_inplace)
    stage3.DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct = _constants_on_device(
        stage3.DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct)
    ds_engine.clip_grad_norm_ = _constants_on_device(ds_engine.clip_grad_norm_)
    pipe_engine.PipelineEngine._aggregate_total_loss = _constants_on_device(
        pipe_engine.PipelineEngine._aggregate_total_loss)
    _zero3_waits()
    _install_guard()
