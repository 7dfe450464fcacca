"""The training step on a tiny model: inputs' dtypes, the weighted loss (padding changes nothing), evaluation."""
import math

import pytest
import torch

from app.core import step, tasks
from app.observe.metrics import Meter

CPU = torch.device("cpu")


class _Engine(torch.nn.Module):
    """What TrainStep uses of DeepSpeed's engine: its forward, backward and step, its device, precision and shards."""

    def __init__(self, module: torch.nn.Module, dtype=torch.float32):
        super().__init__()
        self.module, self.device, self.dtype, self.steps, self.modes = module, CPU, dtype, 0, []

    def forward(self, *inputs):
        self.modes.append(self.training)
        return self.module(*inputs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.steps += 1

    def bfloat16_enabled(self):
        return self.dtype == torch.bfloat16

    def fp16_enabled(self):
        return self.dtype == torch.float16

    def autotp_size(self):
        return 1


def _linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_floating_inputs_take_the_engines_dtype_and_ids_labels_and_weights_keep_theirs(dtype):
    images, ids, positions = torch.rand(2, 4, dtype=torch.float64), torch.arange(6).view(2, 3), torch.zeros(2, 3).long()
    labels, weights = torch.tensor([1.5, 2.5]), torch.tensor([1 / 3, 0.0])
    (x,), y, w = step.to_device((images, labels, weights), CPU, dtype)
    assert x.dtype == dtype and y.dtype == torch.float32 and torch.equal(w, weights), "weights never rounded"
    inputs, _, _ = step.to_device(((ids, positions), labels, weights), CPU, dtype)
    assert [t.dtype for t in inputs] == [torch.long, torch.long] and torch.equal(inputs[0], ids)
    assert step.TrainStep(_Engine(_linear(), dtype), tasks.ImageClassification(None), False).dtype == dtype


def test_the_loss_handed_to_backward_is_weighted_so_padding_changes_neither_gradient_nor_meter():
    x, y = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 2, 1])
    padded, whole = _Engine(_linear()), _Engine(_linear())
    task, meters = tasks.ImageClassification(None), [Meter(["loss"], CPU), Meter(["loss"], CPU)]
    step.TrainStep(padded, task, False).micro_step((x, y, torch.tensor([0.5, 0.5, 0.0])), meters[0])
    step.TrainStep(whole, task, False).micro_step((x[:2], y[:2], torch.tensor([0.5, 0.5])), meters[1])
    assert padded.steps == whole.steps == 1, "one engine.step() per micro batch: the engine counts the window"
    for a, b in zip(padded.module.parameters(), whole.module.parameters()):
        assert torch.allclose(a.grad, b.grad)
    reference = _linear()
    torch.nn.functional.cross_entropy(reference(x[:2]), y[:2]).backward()
    assert torch.allclose(padded.module.weight.grad, reference.weight.grad), "the mean over the real samples"
    read = [meter.reduce() for meter in meters]
    assert read[0] == pytest.approx(read[1]) and read[0]["count"] == 2


def test_an_uncompiled_step_runs_the_model_and_loss_as_they_are():
    engine, task = _Engine(_linear()), tasks.ImageClassification(None)
    train_step = step.TrainStep(engine, task, compile_model=False)
    assert not train_step.compiled and train_step.compiler is None
    x, y = torch.ones(2, 4), torch.tensor([0, 1])
    logits, losses = train_step.logits_and_losses([x], y)
    assert torch.equal(logits, engine.module(x)) and torch.equal(losses, task.loss(logits, y))


def test_evaluation_means_over_the_real_samples_and_leaves_the_model_training():
    engine, task = _Engine(_linear()), tasks.ImageClassification(None)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        right = engine.module(x).argmax(-1)
    wrong = (right + 1) % 3
    loader = [(x[:3], torch.cat([right[:2], wrong[2:3]]), torch.tensor([1.0, 1.0, 0.0])),
              (x[3:], right[3:], torch.tensor([1.0, 1.0]))]
    real = torch.cat([x[:2], x[3:]])
    with torch.no_grad():
        expected = task.loss(engine.module(real), torch.cat([right[:2], right[3:]])).mean().item()
    result = step.TrainStep(engine, task, False).evaluate(loader)
    assert result == {"eval_loss": pytest.approx(expected), "eval_accuracy": 1.0}, "the padded sample is not counted"
    assert engine.modes == [False, False] and engine.training, "evaluated in eval mode, then back to training"
    assert all(p.grad is None for p in engine.parameters()), "no gradient from evaluation"


def test_a_language_models_evaluation_weighs_each_row_by_its_answer_tokens_and_adds_perplexity():
    torch.manual_seed(0)
    engine, task = _Engine(torch.nn.Embedding(6, 6)), tasks.CausalLM(None, None)
    ids = torch.tensor([[1, 2, 3, 4], [5, 1, 2, 0]])
    labels = torch.tensor([[1, 2, 3, 4], [5, 1, -100, -100]])
    units = torch.tensor([3.0, 1.0])
    result = step.TrainStep(engine, task, False).evaluate([(ids, labels, units)])
    with torch.no_grad():
        losses = task.loss(engine.module(ids), labels)
    expected = ((losses * units).sum() / units.sum()).item()
    assert result["eval_loss"] == pytest.approx(expected)
    assert result["eval_perplexity"] == pytest.approx(math.exp(expected))
    assert set(result) == {"eval_loss", "eval_accuracy", "eval_perplexity"}
