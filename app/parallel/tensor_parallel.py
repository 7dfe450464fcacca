"""Tensor parallelism through DeepSpeed's AutoTP: the JSON's "tensor_parallel": {"autotp_size": N} shards each
transformer layer's matmuls across N ranks, by the tensor-parallel plan transformers ships for the model's family.

DeepSpeed lays ranks out with each tensor-parallel group on consecutive ranks, so rank r holds shard r % N of
replica r // N; the N ranks of a group must see the same batch. Checkpoints keep DeepSpeed's per-shard files and,
beside them, the full weights gathered at save time, which app.tools.export writes out.
"""
import torch

from app.distributed import dist
from app.ds import internals as ds_internals
from app.errors import UserError

FULL_WEIGHTS = "tensor_parallel_full.pt"
FAMILIES = "llama, qwen2, qwen3, mistral, gemma, granite, gpt_neox (e.g. --model llama-tiny)"


def size(ds: dict, world_size: int, where: str) -> int:
    """The tensor-parallel degree the JSON asks for (1 without "tensor_parallel"), checked against the world."""
    from app.ds.config import zero_stage
    degree = (ds.get("tensor_parallel") or {}).get("autotp_size", 1)
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise UserError(f"{where}: tensor_parallel.autotp_size must be a positive integer, got {degree!r}")
    if degree > 1 and world_size % degree:
        raise UserError(f"{where}: tensor_parallel.autotp_size {degree} does not divide the world size "
                        f"{world_size}; launch a multiple of {degree} ranks, e.g. "
                        f"`deepspeed --num_gpus {degree} app/train.py ...`")
    if degree > 1 and "pipeline" in ds:
        raise UserError(f"{where}: the app runs \"pipeline\" or \"tensor_parallel\", not both at once; drop one")
    if degree > 1 and zero_stage(ds) == 3:
        raise UserError(f"{where}: the app exports tensor-parallel runs from ZeRO stage 0-2 checkpoints; "
                        f"use ZeRO stage 0, 1 or 2 with \"tensor_parallel\"")
    return degree


def data_parallel(degree: int, world_size: int, rank: int) -> tuple:
    """(data-parallel rank, data-parallel size): a tensor-parallel group's ranks share one replica's data."""
    return rank // degree, world_size // degree


def check_model(model, model_name: str):
    """One line unless the model is a transformers model whose family has a tensor-parallel plan."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "base_model_tp_plan", None):
        family = getattr(config, "model_type", "an image model") if config is not None else "an image model"
        raise UserError(f"{model_name} ({family}) has no tensor-parallel plan for DeepSpeed AutoTP; the families "
                        f"that have one are {FAMILIES}; for other models use \"pipeline\" or ZeRO stage 3")


def save_full_weights(engine, folder):
    """Every rank gathers its shards (a collective); rank 0 writes the whole model's fp32 state dict."""
    state = ds_internals.gathered_state_dict(engine)
    if dist.is_main() and state is not None:
        torch.save({name: t.detach().to("cpu", torch.float32).clone() for name, t in state.items()},
                   folder / FULL_WEIGHTS)
