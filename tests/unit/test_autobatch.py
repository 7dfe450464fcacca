"""The micro batch "auto" without ranks: the candidates that split the global batch evenly over the replicas,
the search for the largest that runs, and what a config must give beside it. Real trials on ranks, running out of
memory in training and a resume: tests/e2e/test_autobatch.py."""
import json

import pytest

from app.memory import autobatch
from app.ds import config as ds_config
from app.errors import UserError
from conftest import REPO


def test_candidates_split_the_global_batch_evenly_over_the_replicas():
    assert autobatch.candidates(64, 2) == [1, 2, 4, 8, 16, 32]
    assert autobatch.candidates(24, 4) == [1, 2, 3, 6]


@pytest.mark.parametrize("fits, expected", [(32, 32), (20, 16), (1, 1), (0, 0)])
def test_the_search_takes_the_largest_that_runs_trying_the_whole_share_first(fits, expected):
    tried = []

    def runs(size):
        tried.append(size)
        return "" if size <= fits else "out of memory on rank 1"
    micro, failed = autobatch.largest(autobatch.candidates(64, 2), runs)
    assert micro == expected and tried[0] == 32 and len(tried) <= 4, tried
    assert all(size > fits for size in failed)


@pytest.mark.parametrize("changes, message", [  # with no global batch at all: tests/unit/test_ds_auto.py
    ({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": 64, "gradient_accumulation_steps": 2},
     "gradient_accumulation_steps follows from the micro batch found"),
    ({"train_micro_batch_size_per_gpu": "often", "train_batch_size": 64},
     "train_micro_batch_size_per_gpu must be a positive integer, got 'often'"),
])
def test_an_auto_micro_batch_needs_a_global_batch_and_nothing_else(changes, message, tmp_path):
    ds = json.loads((REPO / "ds_configs" / "dp.json").read_text())
    ds.pop("gradient_accumulation_steps")
    path = tmp_path / "auto.json"
    path.write_text(json.dumps({**ds, **changes}))
    with pytest.raises(UserError, match=message):
        ds_config.load_ds_config(path)


def test_a_global_batch_no_micro_batch_can_split_is_one_line():
    with pytest.raises(UserError, match="train_batch_size 63 cannot be split over 2 data-parallel rank"):
        ds_config.resolve_batch_sizes({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": 63}, 2, "x")


def test_a_trial_a_batchnorm_cannot_train_on_one_sample_says_the_line_a_run_says():
    """A search down to a micro batch of 1 on resnet18 at 32 pixels: the trial's failure names the config's micro
    batch, as the run's step would, not BatchNorm's own complaint."""
    import torch
    from app.memory.autobatch import _outcome
    norm = torch.nn.BatchNorm2d(4).train()
    kind, why = _outcome(lambda: norm(torch.zeros(1, 4, 1, 1)))
    assert kind == "fatal" and why.startswith("a BatchNorm layer cannot train on one value per channel (its input is "
                                              "[1, 4, 1, 1])") and "train_micro_batch_size_per_gpu to 2 or more" in why
    assert _outcome(lambda: norm(torch.zeros(2, 4, 1, 1))) == ("", "")
