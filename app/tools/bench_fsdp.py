"""The benchmark's fsdp2 mode: torch's own fully sharded data parallel (FSDP2, `fully_shard`), the peer a user would
pick instead of DeepSpeed ZeRO-3, trained by the raw modes' loop (bench_torch.train) on the same model and data."""
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from app.core import compiling, models
from app.tools.bench_common import DTYPES, Workload, build_model, param_bytes
from app.tools.bench_torch import train

# fp32 weights gathered, fp32 gradients reduced, the forward under autocast in --dtype: as the raw loop and the app's
# modes train, so that the speeds compare like for like. param_dtype=bf16 would gather bf16 weights and reduce bf16
# gradients: less traffic, but another precision than the modes beside it.
FP32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def blocks(model) -> list:
    """The modules sharded one by one, each gathered just before its forward and released after it: a transformers
    model's layers, the classes it names in `_no_split_modules` (what accelerate wraps for FSDP; the most frequent of
    them, as activation checkpointing picks). None for the image models (cnn, mlp, torchvision): their root alone."""
    return models.named_blocks(model)


def shard(model, world, compiled: bool) -> list:
    """Shard model over every rank of the device group (gloo on CPU, NCCL on GPUs), block by block and then the
    root, which keeps what no block holds (embeddings, final norm, head); the blocks. compiled: each block (the
    whole model where there is none) compiled in place first, as torchtitan compiles before it shards; FSDP2's
    hooks stay outside the graphs (torch skips them when it traces), so each block is one graph."""
    mesh = init_device_mesh(world.device.type, (world.world_size,))  # 1-D, the whole world: the default group
    found = blocks(model)
    for block in found:
        if compiled:
            block.compile(dynamic=False)
        fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=FP32)
    if compiled and not found:
        model.compile(dynamic=False)
    fully_shard(model, mesh=mesh, mp_policy=FP32)
    return found


def run_fsdp2(mode, args, world, work: Workload, loader, clock, total):
    """The raw loop on the model sharded by FSDP2 (shard above): the same AdamW, clipping and autocast dtype as
    raw and raw-compile; returns (None, dtype, compiled, the bytes of this rank's shards).

    It compiles as the app modes do when --compile names one choice (auto, the default: on CUDA devices only, where
    the compile time is won back; on; off), and as auto when it names several (the app modes then run each way, and
    FSDP2 once). Compiled means as raw-compile: each block compiled, the loss compiled, the fused AdamW."""
    compiled = compiling.wanted(args.compile[0] if len(args.compile) == 1 else "auto", world.device)
    model = build_model(work).to(world.device)
    shard(model, world, compiled)  # before the optimizer is built: it steps the sharded parameters
    train(model, model, compiled, args, world, work, loader, clock, total)
    return None, DTYPES[args.dtype], compiled, param_bytes(model)
