"""ZeRO-3's weights gathered whole for a forward-only pass of the whole model (generation), as TRL's
unwrap_model_for_generation does: one all-gather of every weight instead of one per layer for each new token."""
import contextlib


def zero3_offload(engine):
    """The engine's ZeRO-3 parameter manager (DeepSpeedZeRoOffload), or None under ZeRO 0-2."""
    if engine.zero_optimization_stage() != 3:
        return None
    optimizer = engine.optimizer
    return getattr(optimizer, "parameter_offload", None) or optimizer


@contextlib.contextmanager
def whole_weights(engine, enabled: bool = True):
    """Under ZeRO-3 (and enabled): every weight of the engine's module gathered on every rank, and the module hooks
    that gather and release them layer by layer taken off while the block runs; afterwards the hooks are registered
    again as the engine made them (DeepSpeed drops its recorded gather order and records it anew at the next
    forward) and the weights go back to their partitions. A collective: every rank enters it together. Else a
    no-op."""
    offload = zero3_offload(engine) if enabled else None
    if offload is None:
        yield
        return
    import deepspeed
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        for param in params:
            param.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload._register_deepspeed_module(offload.module)


def whole_bytes(engine) -> int:
    """Bytes the module's weights take gathered whole, in the dtype each is kept in (ZeRO-3's ds_numel: the whole
    tensor's elements, not the rank's partition)."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in engine.module.parameters())
