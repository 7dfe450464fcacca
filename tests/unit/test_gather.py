"""The whole model gathered for generation: a no-op outside ZeRO-3, and the bytes it takes gathered. Under a real
ZeRO-3 engine on 2 ranks (completions equal to those sampled layer by layer): tests/e2e/test_grpo.py."""
from types import SimpleNamespace

import torch

from app.ds.internals import gather


def _engine(stage: int, module: torch.nn.Module):
    """What gather reads of DeepSpeed's engine: its ZeRO stage and module."""
    return SimpleNamespace(zero_optimization_stage=lambda: stage, module=module, optimizer=None)


def test_outside_zero3_or_when_not_enabled_nothing_is_gathered_nor_unhooked():
    module = torch.nn.Linear(4, 2)
    hooks = dict(module._forward_pre_hooks)
    for engine, enabled in ((_engine(0, module), True), (_engine(2, module), True), (_engine(3, module), False)):
        with gather.whole_weights(engine, enabled):
            assert dict(module._forward_pre_hooks) == hooks
        assert gather.zero3_offload(engine) is None or engine.zero_optimization_stage() == 3


def test_the_whole_weights_bytes_count_each_tensors_whole_elements_in_its_dtype():
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).to(torch.bfloat16))
    assert gather.whole_bytes(_engine(0, module)) == (4 * 3 + 3) * 4 + (3 * 2 + 2) * 2
    partitioned = torch.nn.Linear(4, 3)
    for param in partitioned.parameters():  # as ZeRO-3 leaves them: an empty tensor, the whole size in ds_numel
        param.ds_numel, param.data = param.numel(), torch.empty(0)
    assert gather.whole_bytes(_engine(3, partitioned)) == (4 * 3 + 3) * 4
