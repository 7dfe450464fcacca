"""The task contract (app/core/task.py): every hook has a default the core can call on any task unconditionally,
and a new kind of training is a subclass that overrides only what it changes."""
import pytest
import torch

from app.core.step import TrainStep
from app.core.task import Task
from app.data import Data
from app.data import DataInfo
from app.errors import UserError
from app.parallel import layout
from app.settings import Settings


class Doubled(Task):
    """A kind of training written for this test: the loss and model alone."""
    name = "doubled"

    @staticmethod
    def loss(logits, labels):
        return 2 * (logits.squeeze(-1) - labels) ** 2

    def build_model(self, info, ds_config):
        return torch.nn.Linear(4, 1)


def test_a_task_that_overrides_only_its_loss_and_model_answers_every_hook():
    task = Doubled(Settings(model="mlp"))
    assert task.loss(torch.ones(2, 1), torch.zeros(2)).tolist() == [2.0, 2.0]
    assert (task.tokens_per_sample, task.log_columns, task.reference_kind, task.spec) == (0, (), "", None)
    assert task.summary_metrics == ("eval_loss", "eval_accuracy")
    assert task.eval_metrics(1.0) == {} and task.per_sample() == {} and task.record() == {}
    assert task.answer_prompts(3) == [] and task.eager_because(3) == ""
    assert task.flops_per_sample(task.build_model(None, {}), None) == 0.0
    assert task.before_search({}, 1) is None and task.after_trial() is None and task.save_files(None) is None
    with pytest.raises(UserError, match="the benchmark runs image classifiers and causal language models"):
        task.sample_data(4, 8)


def test_the_default_step_is_the_training_step_over_the_tasks_loss():
    task = Doubled(Settings(model="mlp"))
    engine = torch.nn.Linear(4, 1)
    engine.device = torch.device("cpu")
    engine.bfloat16_enabled = engine.fp16_enabled = lambda: False
    step = task.make_step(engine, False)
    assert type(step) is TrainStep and step.task is task and step.metrics == ["loss"]


def test_packed_rows_are_refused_on_pipeline_stages_by_every_task():
    ranks = layout.rank_layout({"pipeline": {"stages": 2}}, 2, 0, "pipe.json")
    packed = Data([], [], DataInfo(0, task="causal_lm", packed=True))
    with pytest.raises(UserError, match="packing and pipeline stages"):
        Doubled(Settings(model="mlp"), packed).check_layout(ranks)
    Doubled(Settings(model="mlp"), packed).check_layout(layout.rank_layout({}, 2, 0, "dp.json"))
