"""fp16's dynamic loss scale read where DeepSpeed 0.19.8 keeps it: its real scaler classes, at and above the minimum."""
from types import SimpleNamespace

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaleConfig, LossScaler

from app.ds.internals import scale_searching


def _engine(optimizer, fp16=True):
    return SimpleNamespace(optimizer=optimizer, fp16_enabled=lambda: fp16)


def test_a_zero_optimizers_dynamic_scale_searches_until_its_minimum():
    scaler = DynamicLossScaler(init_scale=2.0 ** 32, scale_window=1000, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)
    engine = _engine(SimpleNamespace(loss_scaler=scaler))
    assert scale_searching(engine)
    scaler.cur_scale = 1
    assert not scale_searching(engine), "at the minimum an overflow is no search: the gradients are not finite"
    assert not scale_searching(_engine(SimpleNamespace(loss_scaler=LossScaler(128)))), "a static scale"
    assert not scale_searching(_engine(SimpleNamespace(loss_scaler=scaler), fp16=False))


def test_zero_0s_fp16_optimizer_scale_searches_until_its_minimum():
    args = {"init_scale": 2.0 ** 16, "scale_window": 1000, "min_scale": 1.0, "delayed_shift": 2,
            "consecutive_hysteresis": False}
    config = LossScaleConfig(torch.float16, dynamic_loss_scale=True, static_loss_scale=1.0, dynamic_loss_args=args)
    engine = _engine(SimpleNamespace(loss_scale_config=config))
    assert scale_searching(engine)
    config.cur_scale = config.min_loss_scale
    assert not scale_searching(engine)
    static = LossScaleConfig(torch.float16, dynamic_loss_scale=False, static_loss_scale=128.0, dynamic_loss_args=None)
    assert not scale_searching(_engine(SimpleNamespace(loss_scale_config=static)))
