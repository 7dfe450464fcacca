"""The main rank's files of a run: log lines or a progress bar, metrics.csv, TensorBoard, summary, plot; the output
folder check."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from app.data import sources
from app.data.samples import Samples
from app.observe import metrics
from app.observe import runlog


def test_run_log_without_an_output_dir_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    log = runlog.RunLog(None, 3, throughput=metrics.Throughput(tokens_per_sample=10))
    log.train_row(1, 0, 2.0, 0.1, samples=8, seconds=2.0)
    log.write_row({"step": 1, "epoch": 0, "eval_loss": 1.0})
    log.advance(1)
    log.message("hello")
    log.finish({"steps": 1})
    assert list(tmp_path.iterdir()) == [] and capsys.readouterr().out == ""
    assert log.rates(8, 2.0) == {"samples_per_s": 4.0, "tokens_per_s": 40.0}, "rates still computed"


def test_run_log_writes_rows_summary_and_plot_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    log = runlog.RunLog(out, 4, throughput=metrics.Throughput(tokens_per_sample=32, flops_per_sample=1e6,
                                                              peak_flops=4e9))
    log.train_row(1, 0, 2.5, 0.001, samples=64, seconds=2.0)
    log.write_row({"step": 1, "epoch": 0, "eval_loss": 2.25, "eval_accuracy": 0.5, "eval_perplexity": 9.4877})
    log.train_row(2, 0, 2.0, 0.002, samples=64, seconds=1.0)
    log.finish({"steps": 2})
    assert "step 1 epoch 0 loss 2.5 lr 0.001 samples_per_s 32 tokens_per_s 1024 mfu 0.008" in capsys.readouterr().out
    rows = runlog.read_rows(out / "metrics.csv")
    assert [(r["step"], r["loss"], r["eval_loss"]) for r in rows] == [(1, 2.5, None), (1, None, 2.25), (2, 2.0, None)]
    assert rows[2]["samples_per_s"] == 64.0 and rows[2]["tokens_per_s"] == 2048.0 and rows[2]["mfu"] == 0.016
    assert json.loads((out / "summary.json").read_text()) == {"steps": 2}
    assert (out / "loss.png").stat().st_size > 1000 and list((out / "tensorboard").glob("events.out.tfevents.*"))
    # resumed from a checkpoint at step 1: the rows after it are redone, so they go
    again = runlog.RunLog(out, 4, resumed_step=1)
    again.train_row(2, 0, 1.5, 0.002, samples=64, seconds=1.0)
    again.finish({"steps": 2})
    assert [(r["step"], r["loss"]) for r in runlog.read_rows(out / "metrics.csv")] == [(1, 2.5), (1, None), (2, 1.5)]


@pytest.mark.parametrize("show, plain", [(True, False), (False, True), (None, True)])  # None: no terminal here
def test_run_log_progress_bar_or_plain_lines(show, plain, tmp_path):
    log = runlog.RunLog(tmp_path / "run", 4, show_progress=show)
    assert log.plain is plain
    log.train_row(1, 0, 2.0, 0.1, samples=8, seconds=1.0)
    log.finish({})


def test_the_columns_name_each_source_the_sets_declare():
    """Several sources: each one's evaluation and what it gave to training get columns; a foreign set (a
    TensorDataset) and a set of one source, none."""
    train, held = Samples(), Samples()
    train.sources = sources.Sources(["a", "b"], [0, 2, 4], np.ones(4))
    held.sources = sources.Sources(["a", "b"], [0, 1, 2], np.ones(2))
    task = SimpleNamespace(log_columns=("eval_rewards",))
    found = runlog.columns(task, train, held)
    assert found[:1] == ("eval_rewards",) and "eval_loss/a" in found and "eval_rewards/b" in found
    assert found[-4:] == ("rows/a", "rows/b", "tokens/a", "tokens/b")
    foreign = TensorDataset(torch.zeros(2))
    assert runlog.columns(task, foreign, foreign) == runlog.columns(task, Samples(), Samples()) == ("eval_rewards",)
