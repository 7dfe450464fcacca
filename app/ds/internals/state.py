"""What an engine holds and saves, by tensor: parameters, gradients, moments, fp32 masters."""
from pathlib import Path

import torch


def zero_tensors(engine) -> dict:
    """This rank's parameter, gradient, optimizer-moment and fp32 master tensors, as lists, by what they are.

    Read inside an optimizer step or at the end of a backward (gradients exist only between the two), from the ZeRO
    optimizers' own buffers and the parameters' gradients.
    """
    stage, optimizer = engine.zero_optimization_stage(), engine.optimizer
    module_params = list(engine.module.parameters())
    params = [p.ds_tensor if stage == 3 else p for p in module_params]
    if stage == 0:
        grads = [p.grad for p in module_params]
    elif stage == 3:
        grads = [optimizer.grad_partitions_flat_buffer]
    else:
        grads = [g for group in getattr(optimizer, "averaged_gradients", {}).values()  # None between steps; the
                 for g in group or ()]  # bf16 section's ZeRO-1 optimizer (BF16_Optimizer) keeps none apart
        grads += [p.grad for p in module_params if p.grad is not None]  # ZeRO-1 before its reduction: all whole
    inner = getattr(optimizer, "optimizer", optimizer)
    moments = [t for state in inner.state.values() for t in state.values()]
    # DeepSpeed's ZeRO optimizers keep an fp32 master partition even when training in fp32
    masters = getattr(optimizer, "single_partition_of_fp32_groups", None) or \
        getattr(optimizer, "fp32_partitioned_groups_flat", None) or getattr(optimizer, "fp32_groups_flat_partition", [])
    return {"params": params, "grads": grads, "moments": moments, "masters": list(masters)}


def storages(tensors) -> dict:
    """Bytes of each distinct storage behind tensors, by address (views of one flat buffer count once)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors if isinstance(t, torch.Tensor) and t.numel()}


def state_bytes(engine, first: bool) -> int:
    """Bytes a checkpoint takes of this rank (first: data-parallel rank 0): under ZeRO 1-3 its partition of the
    optimizer state, under ZeRO-3 its partition of the weights too; what every rank holds whole (the weights
    below ZeRO-3, all of the optimizer state under ZeRO 0) is saved once, by the first rank."""
    stage, tensors = engine.zero_optimization_stage(), zero_tensors(engine)
    saved = [p.ds_tensor if stage == 3 else p for p in engine.module.parameters() if p.requires_grad]  # LoRA: no base
    own = {**(storages(saved) if stage == 3 or first else {}),
           **(storages(tensors["moments"]) | storages(tensors["masters"]) if stage > 0 or first else {})}
    return sum(own.values()) + _swapped_bytes(engine)


def _swapped_bytes(engine) -> int:
    """Bytes of the optimizer state this rank swapped to NVMe (ZeRO-3), which DeepSpeed copies into each checkpoint
    (its offloaded_tensors/), gradients aside: in memory those masters and moments are empty."""
    if not engine.zero_nvme_offload_optimizer():
        return 0
    folder = Path(engine.optimizer.optimizer_swapper.swap_folder)
    return sum(path.stat().st_size for path in folder.glob("*.swp") if "gradient" not in path.name)


def module_states(folder) -> dict:
    """The whole module's state dict from a ZeRO stage 0 checkpoint folder (DeepSpeed's own file name for it)."""
    states = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    return states["module"]


def deepspeed_estimate(stage: int, offload: bool, offload_params: bool, total: int, largest_layer: int,
                       gpus: int):
    """GPU bytes per rank that DeepSpeed's own estimator gives for ZeRO 2 or 3 (it has none for 0 and 1), or None.
    It assumes fp16 weights and Adam, and counts no activations."""
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        return estimate_zero2_model_states_mem_needs(total, gpus, 1, cpu_offload=offload)[1]
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        return estimate_zero3_model_states_mem_needs(total, largest_layer, gpus, 1, cpu_offload=offload,
                                                     cpu_offload_params=offload_params)[1]
    return None



def held_weights(engine) -> list:
    """The weights this rank holds: whole parameters, or under ZeRO-3 its partition of each (without the padding
    DeepSpeed leaves uninitialised at the end of the last rank's partitions)."""
    import torch.distributed as torch_dist
    held = []
    for param in engine.module.parameters():
        partition = getattr(param, "ds_tensor", None)
        if partition is None:
            held.append(param.detach())
            continue
        size = partition.ds_numel
        start = size * torch_dist.get_rank(group=param.ds_process_group)
        held.append(partition.narrow(0, 0, max(0, min(size, param.ds_numel - start))))
    return held


def weights_finite(engine) -> bool:
    """Whether every weight this rank holds is finite (under ZeRO-3 its partitions, wherever they are kept)."""
    by_device = {}
    for tensor in held_weights(engine):
        if tensor.numel():
            by_device.setdefault(tensor.device, []).append(torch.isfinite(tensor).all())
    return all(bool(torch.stack(flags).all()) for flags in by_device.values())
