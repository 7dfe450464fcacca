"""What the loader reads of a set (app/data/samples.py): every set the app builds declares units, sources, stream
and per_sample; a foreign set (torchvision's, a TensorDataset) reads as the defaults; the loss weights of a window."""
import datasets
import pytest
import torch
from torch.utils.data import Subset, TensorDataset

from app.data import chat, loader, preference, samples, stream, text
from app.data.samples import Samples, declared


def test_every_set_the_app_builds_declares_what_the_loader_reads():
    """The loader and the log read units, sources and stream plainly, and a text task asks per_sample: each set
    class answers them (a class that dropped the base would be read as a foreign set, its units lost)."""
    made = (text.Rows, chat.AnswerRows, chat.PackedRows, preference.PairRows, stream.StreamSet, loader.Part)
    assert all(issubclass(cls, Samples) for cls in made)
    answers = datasets.Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "answer": [1, 3],
                                           "units": 2}, {"input_ids": [4, 5], "labels": [-100, 5], "answer": [1, 2],
                                                         "units": 1}])
    rows = chat.AnswerRows(answers, 0, 3)
    blocks = text.Rows(datasets.Dataset.from_list([{"input_ids": [1, 2]}]), 0)
    assert declared(rows).units == [2, 1] and declared(chat.PackedRows(rows, 8)).units == [3]
    assert (blocks.units, blocks.sources, blocks.stream, blocks.per_sample()) == (None, None, None, {})
    assert rows.per_sample() == {"rows": 1.0, "real_tokens": 2.5}, "a set's own per_sample replaces the default"
    assert declared(loader.Part(rows, 1, 2)).units == [1]


@pytest.mark.parametrize("foreign", [TensorDataset(torch.zeros(4, 2), torch.zeros(4)),
                                     Subset(TensorDataset(torch.zeros(6, 2), torch.zeros(6)), [0, 1, 2, 3])])
def test_a_foreign_set_reads_as_the_defaults(foreign):
    found = declared(foreign)
    assert (found.units, found.sources, found.stream, found.per_sample()) == (None, None, None, {})
    built = loader.build_loader(foreign, 2, 0, 1, False, 0)
    assert built.total_units() == 4.0 and [w.tolist() for _, _, w in built] == [[0.5, 0.5]] * 2, "one unit a sample"


@pytest.mark.parametrize("world, accumulation", [(1, 1), (2, 3), (4, 2)])
def test_the_weights_of_a_window_add_up_to_the_world_times_the_accumulation(world, accumulation):
    """DeepSpeed divides each micro batch's loss by A and averages over W ranks: weights summing to W x A over the
    window make the step's loss the mean over its units."""
    units = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0]
    weighed = samples.weights(units, sum(units), world, accumulation)
    assert sum(weighed) == pytest.approx(world * accumulation)
    assert weighed[5] / weighed[1] == pytest.approx(9.0), "in proportion to each sample's units"
