"""Constants DeepSpeed makes from Python numbers inside its step, made on the device instead.

`torch.tensor(-1.0, device=cuda)` copies a Python number from the host, which makes the host wait; `torch.full`
makes the same tensor, bit for bit, with a fill kernel on the same stream, so nothing is reordered. And the mask of a
norm that is not finite fills with a number where DeepSpeed fills with such a tensor, which CUDA's masked_fill_ reads
back on the host. Nothing here answers DeepSpeed's stream or device synchronisations: those stay DeepSpeed's
(docs/gpu.md lists every change).
"""
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


def mask_not_finite(input, device=None, val=-1.0):
    """DeepSpeed's mask_nan_or_inf_with_val_inplace (utils.py) without its two host waits: inf and NaN replaced in
    place by val given as a number, where DeepSpeed copies -1.0 to the device and masked_fill_ reads it back (every
    caller passes no val: the same -1.0)."""
    input.masked_fill_(~torch.isfinite(input), val)


def constants_on_device():
    """The constants of DeepSpeed's step made on the device: ZeRO 1-3's mask of an invalid norm and ZeRO-3's norm
    of no gradients, the clip's `max_norm` and `1.0` on pipelines and tensor parallelism (DeepSpeed's own
    clip_grad_norm_), and a non-last pipeline stage's loss buffer."""
    from deepspeed.runtime import engine as ds_engine
    from deepspeed.runtime.pipe import engine as pipe_engine
    from deepspeed.runtime.zero import stage3, stage_1_and_2
    for module in (stage_1_and_2, stage3):
        module.mask_nan_or_inf_with_val_inplace = mask_not_finite
    stage3.DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct = _constants_on_device(
        stage3.DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct)
    ds_engine.clip_grad_norm_ = _constants_on_device(ds_engine.clip_grad_norm_)
    pipe_engine.PipelineEngine._aggregate_total_loss = _constants_on_device(
        pipe_engine.PipelineEngine._aggregate_total_loss)
