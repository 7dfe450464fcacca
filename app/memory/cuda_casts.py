"""CUDA's autocast, as the memory plan needs it on a machine without a GPU: which dtype each operation of a forward
pass computes in, and so which copies its backward keeps.

CPU autocast casts other operations than CUDA's: it leaves layer norms, softmaxes, exponentials and powers in bf16,
where CUDA's computes them in fp32 and keeps fp32 activations (GPT-2's tanh GELU, whose cube goes through pow,
runs wholly in fp32 on a GPU). A plan counted under CPU autocast misses those bytes on the GPU it plans for. This
mode applies CUDA's policy lists (ATen's autocast_mode.h: lower precision, fp32, fp32 with the dtype set, widest
type) to the torch functions a model calls, to tensors of any device, fake ones included. Like CUDA's autocast it
casts each weight (a leaf that requires a gradient) once while it is active, and casts inside a function it has
cast for are left alone, as autocast's are.
"""
import contextlib

import torch
from torch.overrides import TorchFunctionMode

from app.ds.internals import torch_private

LOWER = {"_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
         "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
         "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "lstm_cell",
         "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention", "__matmul__", "__rmatmul__"}
FP32 = {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "rms_norm", "group_norm",
        "frobenius_norm", "nuclear_norm",
        "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss", "kl_div",
        "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
        "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
        "pdist", "cdist", "renorm", "logsumexp", "interpolate", "upsample", "upsample_nearest", "upsample_bilinear",
        # cross_entropy is log_softmax (fp32, set below) then nll_loss (fp32) under CUDA's autocast
        "cross_entropy"}
FP32_DTYPE = {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "vector_norm",
              "linalg_matrix_norm", "matrix_norm", "sum", "norm"}
WIDEST = {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
          "tensordot", "scatter_add", "cat", "concat", "concatenate", "stack"}
SIXTEEN = (torch.bfloat16, torch.float16)


class CudaAutocast(TorchFunctionMode):
    """CUDA's autocast to dtype (bf16 or fp16) on the torch functions called under it, whatever their tensors'
    device, while CPU autocast is on: in forward(), and where torch's checkpoint turns it on again to recompute a
    block in the backward pass (which must then run under the mode too: torch_private.backward)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.cached = dtype, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, name = kwargs or {}, getattr(func, "__name__", "")
        if not torch.is_autocast_enabled("cpu"):  # off, as autocast is, outside forward() and what restores it
            return func(*args, **kwargs)
        if name in LOWER:
            args, kwargs = self._cast((args, kwargs), self.dtype)
        elif name in FP32:
            args, kwargs = self._cast((args, kwargs), torch.float32)
        elif name in FP32_DTYPE and kwargs.get("dtype") is None and args and _floating(args[0]):
            kwargs = {**kwargs, "dtype": torch.float32}
        elif name in WIDEST:
            found = [t.dtype for t in _tensors((args, kwargs)) if t.is_floating_point()]
            if len(set(found)) > 1:
                args, kwargs = self._cast((args, kwargs), max(found, key=lambda d: torch.finfo(d).bits))
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def forward(self):
        """The forward pass: CPU autocast on beneath the casts, for the code that asks whether autocast is on and in
        which dtype (torch's checkpoint, to recompute a block as its forward ran; a tiled MLP); at its end the
        weights' casts are forgotten, as CUDA's autocast forgets them when it exits."""
        with torch.autocast("cpu", dtype=self.dtype):
            yield
        self.cached.clear()

    def _cast(self, tree, dtype: torch.dtype):
        """tree with each floating tensor (one of 16 or 32 bits) in dtype; a weight's cast is made once."""
        return torch_private.tree_map(lambda value: self._cast_one(value, dtype), tree)

    def _cast_one(self, value, dtype: torch.dtype):
        if not _floating(value) or value.dtype == dtype or value.dtype not in (*SIXTEEN, torch.float32):
            return value
        if not (value.is_leaf and value.requires_grad):
            return value.to(dtype)
        key = (id(value), dtype)
        if key not in self.cached:
            self.cached[key] = (value, value.to(dtype))  # the weight itself is kept so that its id is not reused
        return self.cached[key][1]


def _floating(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _tensors(tree) -> list:
    return [value for value in torch_private.tree_flatten(tree)[0] if isinstance(value, torch.Tensor)]
