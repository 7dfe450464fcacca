"""The optimizer states the memory plan counts per trained parameter (app/memory/optimizer_states.py), against
torch's optimizers' own state after a step, and the plan's optimizer column."""
import pytest
import torch

from app.memory import estimate, optimizer_states


@pytest.mark.parametrize("name, params", [
    ("SGD", {"lr": 0.1}), ("SGD", {"lr": 0.1, "momentum": 0.9}), ("Adam", {}), ("AdamW", {}), ("AdamW", {"amsgrad": True}), ("Adagrad", {}),
    ("Adadelta", {}), ("Adamax", {}), ("NAdam", {}), ("RAdam", {}), ("Rprop", {}), ("ASGD", {}), ("RMSprop", {}),
    ("RMSprop", {"momentum": 0.9, "centered": True})])
def test_the_states_counted_are_what_torchs_optimizer_keeps_after_a_step(name, params):
    """Values of a parameter's size that the optimizer keeps (scalars, as its step count, aside)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 4))
    optimizer = getattr(torch.optim, name)([weight], **params)
    weight.grad = torch.randn(8, 4)
    optimizer.step()
    kept = sum(value.numel() for value in optimizer.state[weight].values()
               if torch.is_tensor(value) and value.numel() > 1) / weight.numel()
    assert optimizer_states.state_words({"optimizer": {"type": name, "params": params}}) == kept


def test_the_plan_counts_the_configs_optimizer_and_adamw_without_one():
    """1,000 parameters on one rank in fp32: SGD without momentum keeps nothing, Lion and Adagrad one moment,
    AdamW (a file without an optimizer gets it) two."""
    held = {name: estimate.model_states([1000], {"optimizer": {"type": name}} if name else {}, 1)[0]["optimizer"]
            for name in ("SGD", "Lion", "Adagrad", "AdamW", "")}
    assert held == {"SGD": 0, "Lion": 4000, "Adagrad": 4000, "AdamW": 8000, "": 8000}
    offloaded = {"optimizer": {"type": "Lion"},
                 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert estimate.model_states([1000], offloaded, 1)[1]["optimizer"] == 4000
