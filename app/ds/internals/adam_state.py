"""An offloaded Adam's state after a checkpoint load, continued as the unbroken run would have: CPU Adam's running
bias-correction product, and a ZeRO-3 optimizer state swapped to NVMe."""
from pathlib import Path

import torch


def replay_cpu_adam_steps(engine):
    """Make DeepSpeed's CPU Adam (offload) continue bit-identically after a checkpoint load.

    Its C++ side keeps beta**step as a running product; a fresh optimizer recomputes it with pow(),
    which rounds differently. Replaying the step count on empty tensors rebuilds the same product.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    inner = getattr(engine.optimizer, "optimizer", None)
    if not isinstance(inner, DeepSpeedCPUAdam):
        return
    steps = max((int(state["step"]) for state in inner.state.values() if "step" in state), default=0)
    group, empty = inner.param_groups[0], torch.empty(0)
    beta1, beta2 = group["betas"]
    for step in range(1, steps + 1):
        inner.ds_opt_adam.adam_update(inner.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                      group["weight_decay"], group["bias_correction"], empty, empty, empty, empty)


def restore_swapped_adam(engine, folder: Path):
    """Give a ZeRO-3 optimizer offloaded to NVMe the state `folder` (a checkpoint's tag folder) saved.

    DeepSpeed 0.19.8 loads such a checkpoint by copying the saved swap files (`offloaded_tensors`) into the swap
    folder and skips the optimizer's own file, so its Adam starts every partition afresh: step 0 and zero moments,
    which the next swap-out writes over the copied ones (measured: tests/e2e/test_nvme.py). Here the optimizer
    loads its saved state dict (step counts, moments kept in memory, fp16's loss scale) as DeepSpeed's other ZeRO-3
    loads do, and each moment that was swapped out is named for its copied file, as DeepSpeed names it when it
    swaps it out, so the next swap-in reads it. A partition too small to swap keeps its fp32 weights in memory,
    which that load does not restore either: they, and the model's copy of them, take the saved ones."""
    if not engine.zero_nvme_offload_optimizer():
        return
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT
    zero = engine.optimizer
    path = engine._get_zero_ckpt_name(str(folder.parent), folder.name)
    saved = engine.checkpoint_engine.load(path, map_location="cpu")[OPTIMIZER_STATE_DICT]
    zero.checkpoint_event_prologue()  # as DeepSpeed's load begins: every weight partitioned, persistent ones too
    zero.loss_scaler, zero.dynamic_loss_scale = saved[LOSS_SCALER], saved["dynamic_loss_scale"]  # fp16's scale
    zero.overflow = saved["overflow"]
    zero._set_fp32_optimizer_param_groups()
    zero.optimizer.load_state_dict(saved[OPTIMIZER_STATE_DICT])
    zero._clear_fp32_optimizer_param_groups()
    zero.optimizer_swapper.purge_state()  # as DeepSpeed's other load: no state tensor of this engine's own left
    for group, flat in enumerate(zero.fp32_partitioned_groups_flat):
        swap = zero.optimizer_swapper.swap_params_info.get(flat.ds_id)
        if swap is None:  # below DeepSpeed's least swap, in memory: the saved weights, then the model's partitions
            flat.data.copy_(saved[FP32_FLAT_GROUPS][group].data)
            zero._reassign_or_swap_out_partitioned_parameters(group)
            continue
        moments = _swapped_moments(zero.optimizer.state.get(flat, {}), flat.ds_id, _copied_from(engine, folder))
        if moments:  # none before the partition's first step: DeepSpeed names them when Adam makes them
            swap.add_state_tensors(moments)
    zero.checkpoint_event_epilogue()  # as it ends: the persistent weights gathered whole again


def _copied_from(engine, folder: Path) -> Path:
    """The folder of `folder`'s swap files that DeepSpeed's load copied into this rank's swap folder."""
    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str
    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    return folder / "offloaded_tensors" / f"rank{dp_index_to_str(rank)}"


def _swapped_moments(state: dict, ds_id: str, folder: Path) -> list:
    """The tensors of a partition's loaded state whose files the load copied (from `folder`), named as DeepSpeed
    names them ('<state name>-<partition's ds_id>') and emptied: the next swap-in gives them the file's data. (The
    saved ones are empty, or with pipeline_read/pipeline_write, whose swapper never empties them, stale views of
    its buffers.)"""
    moments = []
    for name, value in state.items():
        if torch.is_tensor(value) and (folder / f"{name}-{ds_id}.tensor.swp").is_file():
            value.data = torch.empty(0, dtype=value.dtype)
            value.ds_id = f"{name}-{ds_id}"
            moments.append(value)
    return moments
