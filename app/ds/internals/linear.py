"""DeepSpeed's memory-efficient linear: the autograd function ZeRO-3 puts in F.linear's place (zero.Init with
memory_efficient_linear, DeepSpeed's default), put in for the memory plan's count and taken out after an engine."""
import contextlib

import torch


def restore_torch_linear():
    """Put torch's own F.linear back. zero.Init with DeepSpeed's memory_efficient_linear (its default) swaps in its
    own for the rest of the process ("This will persist unless manually reset", partition_parameters.py), so a
    later engine of the same process that sets it false (the benchmark's next mode) would still run DeepSpeed's."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patcher
    original = getattr(patcher, "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


@contextlib.contextmanager
def deepspeed_linear():
    """Inside, F.linear is DeepSpeed's zero3_linear_wrap, as a ZeRO-3 engine runs it: its backward saves each
    layer's input as it came and the weight itself (gathered again for the backward), where torch's linear under
    autocast saves their bf16 casts, so a compiled step keeps no bf16 copy of the weights."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    before = torch.nn.functional.linear
    torch.nn.functional.linear = zero3_linear_wrap
    try:
        yield
    finally:
        torch.nn.functional.linear = before
