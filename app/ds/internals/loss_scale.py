"""fp16's dynamic loss scale, as DeepSpeed 0.19.8 keeps it: a DynamicLossScaler on the ZeRO optimizers (loss_scaler),
a LossScaleConfig on ZeRO 0's fp16 optimizers (loss_scale_config)."""


def scale_searching(engine) -> bool:
    """True while the engine's fp16 dynamic loss scale is above its minimum: a step skipped for an overflow is then
    the scaler finding its scale (DeepSpeed halves it and trains on; from an initial_scale_power of 32 that can be
    20 steps in a row), not a run that diverged. False at the minimum, with a static scale, and without fp16."""
    if not engine.fp16_enabled():
        return False
    optimizer = engine.optimizer
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None:
        return bool(scaler.dynamic) and scaler.cur_scale > scaler.min_scale
    config = getattr(optimizer, "loss_scale_config", None)
    return config is not None and config.dynamic_loss_scale and config.cur_scale > config.min_loss_scale
