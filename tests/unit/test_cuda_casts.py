"""CUDA's autocast on a CPU (app/memory/cuda_casts.py): ATen's policy lists, and the dtypes a GPU's forward pass
computes in, which CPU autocast gets otherwise."""
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from app.memory import cuda_casts

HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
# ATen's names a model reaches through another torch function, which the mode sees instead.
THROUGH = {"native_layer_norm": "layer_norm", "nll_loss2d": "nll_loss", "_thnn_fused_lstm_cell": "lstm_cell",
           "_thnn_fused_gru_cell": "gru_cell", "_scaled_dot_product_flash_attention": "scaled_dot_product_attention",
           "linalg_matrix_norm": "matrix_norm", "linalg_vector_norm": "vector_norm"}


def _listed(macro: str) -> set:
    body = re.search(rf"#define {macro}\(_\)(.*?)\n\n", open(HEADER).read(), re.S).group(1)
    return set(re.findall(r"_\((\w+)", body))


@pytest.mark.parametrize("macro, ours", [("AT_FORALL_LOWER_PRECISION_FP", cuda_casts.LOWER),
                                         ("AT_FORALL_FP32", cuda_casts.FP32),
                                         ("AT_FORALL_FP32_SET_OPT_DTYPE", cuda_casts.FP32_DTYPE),
                                         ("AT_FORALL_PROMOTE", cuda_casts.WIDEST)])
def test_every_operation_atens_policy_lists_is_cast_as_cuda_casts_it(macro, ours):
    """This torch's own lists (its headers): an operation a newer torch adds shows up here."""
    listed = _listed(macro)
    upsampling = {name for name in listed if "upsample" in name}  # all reached through F.interpolate
    assert listed and sorted(listed - ours - upsampling - set(THROUGH)) == []
    assert all(THROUGH[name] in ours for name in listed & set(THROUGH))
    assert not upsampling or "interpolate" in ours


def test_in_the_forward_pass_matmuls_run_in_bf16_and_norms_softmaxes_powers_and_sums_in_fp32():
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    casts = cuda_casts.CudaAutocast(torch.bfloat16)
    with casts, casts.forward():
        h = F.linear(x, w)
        assert h.dtype == torch.bfloat16 and (x @ w).dtype == torch.bfloat16
        assert F.layer_norm(h, (8,)).dtype == torch.float32, "CPU autocast leaves it in bf16"
        assert torch.softmax(h, -1).dtype == h.softmax(-1).dtype == torch.float32
        assert h.pow(3).dtype == (h ** 2).dtype == torch.exp(h).dtype == torch.float32
        assert h.sum().dtype == torch.float32 and h.sum(dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.cat([h, x]).dtype == torch.float32, "the widest"
        assert F.linear(x, w).dtype == torch.bfloat16
        assert len(casts.cached) == 1, "the weight is cast once"
    assert casts.cached == {}, "forgotten when the forward pass ends"
    with casts:
        assert F.linear(x, w).dtype == torch.float32, "outside the forward pass (autocast off) nothing is cast"


def test_gpt2s_tanh_gelu_runs_in_fp32_on_a_gpu():
    """Its cube goes through pow, on CUDA's fp32 list: the MLP's activations are fp32 on a GPU, bf16 under CPU
    autocast (what the plan missed: 0.87 of gpt2-124m's eager peak on an H200, docs/memory.md)."""
    from transformers.activations import NewGELUActivation
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert NewGELUActivation()(x).dtype == torch.bfloat16
    casts = cuda_casts.CudaAutocast(torch.bfloat16)
    with casts, casts.forward():
        assert NewGELUActivation()(x).dtype == torch.float32


def test_a_checkpointed_block_is_recomputed_in_the_dtypes_of_its_forward():
    """torch's checkpoint turns CPU autocast on again to recompute; the mode, in force through the backward pass
    (torch_private.backward), casts as in the forward: else the recomputed tensors' dtypes differ and checkpoint
    refuses them."""
    from app.ds.internals import torch_private
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    casts = cuda_casts.CudaAutocast(torch.bfloat16)
    with casts:
        with casts.forward():
            out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).float().sum()
        torch_private.backward(out)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in block.parameters())
