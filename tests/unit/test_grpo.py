"""The GRPO task (app/core/grpo.py): what it refuses in one line, what a checkpoint records of it, its columns."""
import pytest

from app.core import grpo, resolver
from app.errors import UserError
from app.parallel import layout
from app.settings import Settings

REWARD = "def exact(completions, answer, **kwargs):\n    return [float(c == a) for c, a in zip(completions, answer)]\n"


@pytest.fixture
def reward(tmp_path):
    path = tmp_path / "r.py"
    path.write_text(REWARD)
    return f"{path}:exact"


def _task(reward, **given):
    return resolver.build(Settings(model="llama-tiny", task="grpo", reward=reward, **given))


def test_the_task_takes_trls_defaults_and_records_what_a_resume_must_match(reward):
    task = _task(reward, beta="0.04", reward_weights="2")
    assert isinstance(task, grpo.Grpo) and (task.group, task.sequences) == (8, 8)
    assert (task.loss_kind, task.beta, task.epsilon, task.epsilon_high) == ("dapo", 0.04, 0.2, 0.2)
    assert task.reference_kind == "frozen copy" and _task(reward, beta="0.04", lora=True).reference_kind == \
        "adapters off" and _task(reward).reference_kind == "", "beta 0 (auto): no KL term, no reference"
    record = task.record()
    assert record["task"] == "grpo" and record["reward"][0][:2] == ["exact", 2.0] and len(record["reward"][0][2]) == 64
    assert {"grpo_loss", "beta", "num_generations", "max_completion_length", "temperature", "scale_rewards",
            "base"} <= set(record)
    assert "rewards/exact/mean" in task.log_columns and "eval_reward" in task.log_columns
    assert "kl" in task.metrics and "kl" not in _task(reward).metrics
    assert task.summary_metrics == ("eval_reward",)


@pytest.mark.parametrize("given, message", [
    ({"beta": "-1"}, "--beta must be 0 or more"),
    ({"temperature": 0.0}, "--temperature must be above 0"),
    ({"num_iterations": 0}, "--num_iterations must be at least 1"),
    ({"packing": "on"}, "--packing on packs instruction rows"),
    ({"reward": ""}, "--task grpo needs --reward FILE.py:NAME"),
])
def test_settings_grpo_cannot_train_with_are_one_line(reward, given, message):
    """A run's flags, checked before its data is read; the plan's task (no --reward) takes the same ranges."""
    with pytest.raises(UserError, match=message):
        resolver.spec_of(Settings(model="llama-tiny", task="grpo", **{"reward": reward, **given}))
    if "reward" not in given:
        with pytest.raises(UserError, match=message):
            resolver.build(Settings(model="llama-tiny", task="grpo", **given))


def test_the_plans_task_needs_no_reward():
    task = resolver.build(Settings(model="llama-tiny", task="grpo", num_generations=4))
    assert task.rewards == [] and task.sampled == 4


def test_grpo_needs_a_causal_lm_and_a_layout_of_whole_models(reward):
    with pytest.raises(UserError, match="--task grpo trains a causal language model on completions it samples"):
        resolver.build(Settings(model="bert-tiny", task="grpo", reward=reward))
    with pytest.raises(UserError, match="--task grpo trains under data parallel and ZeRO 0-3"):
        _task(reward).check_layout(layout.rank_layout({"pipeline": {"stages": 2}}, 2, 0, "p.json"))
    with pytest.raises(UserError, match="--num_generations must be at least 2"):
        Settings(task="grpo", num_generations=1)


def test_a_cycle_of_steps_shares_its_sampling_and_old_policy_forward_in_the_flops(reward):
    """MFU counts what a step runs: with --num_iterations 2 a cycle samples once and takes the old policy's forward
    of the sequences once, for its 2 steps."""
    from transformers import AutoModelForCausalLM
    from app.core import models
    from app.data import DataInfo
    info = DataInfo(0, task="causal_lm", vocab_size=256, seq_len=40)
    once, cycle = _task(reward, num_generations=4), _task(reward, num_generations=4, num_iterations=2)
    model = models.HFLogits(AutoModelForCausalLM.from_config(once.spec.config))
    train = models.train_flops_per_token(model, 40) * 40
    forward = models.train_flops_per_token(model, 40, forward_only=True)
    max_new = once.how.max_new
    assert once.flops_per_sample(model, info) == pytest.approx(4 * (train + forward * max_new))
    assert cycle.flops_per_sample(model, info) == pytest.approx(4 * (train + forward * (max_new + 40) / 2))
