"""An offloaded Adam continued after a load (app/ds/internals/adam_state.py) on DeepSpeed's own CPU Adam, with no
engine; the NVMe restore needs one and is proven in tests/e2e/test_nvme.py."""
import copy
from types import SimpleNamespace

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

from app.distributed.launch import prepare_environment
from app.ds.internals.adam_state import replay_cpu_adam_steps, restore_swapped_adam

prepare_environment()  # this Python's ninja: DeepSpeed's CPU Adam op loads as built, not rebuilt

GRADS = [torch.randn(4096, generator=torch.Generator().manual_seed(step)) for step in range(8)]


def _adam(weights: torch.Tensor) -> DeepSpeedCPUAdam:
    return DeepSpeedCPUAdam([torch.nn.Parameter(weights.clone())], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)


def _steps(adam: DeepSpeedCPUAdam, grads) -> torch.Tensor:
    (param,) = adam.param_groups[0]["params"]
    for grad in grads:
        param.grad = grad.clone()
        adam.step()
    return param.detach().clone()


def test_a_cpu_adam_loaded_and_replayed_steps_on_bit_for_bit_as_the_unbroken_one():
    """Saved after 3 steps, where pow(beta, 4) and the running product round apart."""
    start = torch.randn(4096, generator=torch.Generator().manual_seed(99))
    unbroken = _adam(start)
    saved_weights = _steps(unbroken, GRADS[:3])
    saved = copy.deepcopy(unbroken.state_dict())
    whole = _steps(unbroken, GRADS[3:])

    unreplayed = _adam(saved_weights)
    unreplayed.load_state_dict(copy.deepcopy(saved))
    assert not torch.equal(_steps(unreplayed, GRADS[3:]), whole), "a fresh optimizer's pow() rounds otherwise"
    resumed = _adam(saved_weights)
    resumed.load_state_dict(saved)
    replay_cpu_adam_steps(SimpleNamespace(optimizer=SimpleNamespace(optimizer=resumed)))
    assert torch.equal(_steps(resumed, GRADS[3:]), whole)


def test_only_deepspeeds_cpu_adam_is_replayed_and_only_an_nvme_optimizer_restored():
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))])
    replay_cpu_adam_steps(SimpleNamespace(optimizer=SimpleNamespace(optimizer=plain)))  # no C++ side to replay
    assert plain.state_dict()["state"] == {}
    untouched = SimpleNamespace(zero_nvme_offload_optimizer=lambda: False)
    restore_swapped_adam(untouched, None)  # reads no file: the engine's own load was whole
