"""Metrics in one process: the stopwatch, meters, throughput, the run's files, and the output directory check."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from app import metrics


class Clock:
    """A perf_counter that moves only when told."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_stopwatch_leaves_out_paused_time(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=clock))
    watch = metrics.Stopwatch()
    clock.now += 5
    with watch.paused():  # evaluation: 3 s
        clock.now += 3
    clock.now += 2
    assert watch.lap() == pytest.approx(7.0)
    clock.now += 1
    with watch.paused():  # saving: 4 s, in two pauses
        clock.now += 1
    with watch.paused():
        clock.now += 3
    clock.now += 0.5
    assert watch.lap() == pytest.approx(1.5), "each lap counts from the last one"
    with pytest.raises(RuntimeError):
        with watch.paused():  # a pause that ends in an exception still does not count
            clock.now += 10
            raise RuntimeError("save failed")
    clock.now += 2
    assert watch.lap() == pytest.approx(2.0)


def test_meter_means_over_the_window_then_resets():
    meter = metrics.Meter(["loss", "accuracy"], torch.device("cpu"))
    meter.add(torch.tensor(4.0), loss=torch.tensor(8.0), accuracy=torch.tensor(3.0))
    meter.add(torch.tensor(2.0), loss=torch.tensor(1.0), accuracy=torch.tensor(2.0))
    assert meter.reduce() == {"loss": 1.5, "accuracy": pytest.approx(5 / 6), "count": 6.0}
    empty = meter.reduce()
    assert empty["count"] == 0 and math.isnan(empty["loss"])


def test_throughput_rates():
    assert metrics.Throughput().rates(64, 2.0) == {"samples_per_s": 32.0}
    assert metrics.Throughput().rates(64, 0.0) == {"samples_per_s": 0.0}
    rates = metrics.Throughput(tokens_per_sample=128, flops_per_sample=2e6, peak_flops=4e9).rates(64, 2.0)
    assert rates == {"samples_per_s": 32.0, "tokens_per_s": 32.0 * 128, "mfu": pytest.approx(32.0 * 2e6 / 4e9)}


def test_run_log_without_an_output_dir_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    log = metrics.RunLog(None, 3, throughput=metrics.Throughput(tokens_per_sample=10))
    log.train_row(1, 0, 2.0, 0.1, samples=8, seconds=2.0)
    log.write_row({"step": 1, "epoch": 0, "eval_loss": 1.0})
    log.advance(1)
    log.message("hello")
    log.finish({"steps": 1})
    assert list(tmp_path.iterdir()) == [] and capsys.readouterr().out == ""
    assert log.rates(8, 2.0) == {"samples_per_s": 4.0, "tokens_per_s": 40.0}, "rates still computed"


def test_run_log_writes_rows_summary_and_plot_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    log = metrics.RunLog(out, 4, throughput=metrics.Throughput(tokens_per_sample=32, flops_per_sample=1e6,
                                                              peak_flops=4e9))
    log.train_row(1, 0, 2.5, 0.001, samples=64, seconds=2.0)
    log.write_row({"step": 1, "epoch": 0, "eval_loss": 2.25, "eval_accuracy": 0.5, "eval_perplexity": 9.4877})
    log.train_row(2, 0, 2.0, 0.002, samples=64, seconds=1.0)
    log.finish({"steps": 2})
    assert "step 1 epoch 0 loss 2.5 lr 0.001 samples_per_s 32 tokens_per_s 1024 mfu 0.008" in capsys.readouterr().out
    rows = metrics.read_rows(out / "metrics.csv")
    assert [(r["step"], r["loss"], r["eval_loss"]) for r in rows] == [(1, 2.5, None), (1, None, 2.25), (2, 2.0, None)]
    assert rows[2]["samples_per_s"] == 64.0 and rows[2]["tokens_per_s"] == 2048.0 and rows[2]["mfu"] == 0.016
    assert json.loads((out / "summary.json").read_text()) == {"steps": 2}
    assert (out / "loss.png").stat().st_size > 1000 and list((out / "tensorboard").glob("events.out.tfevents.*"))
    # resumed from a checkpoint at step 1: the rows after it are redone, so they go
    again = metrics.RunLog(out, 4, resumed_step=1)
    again.train_row(2, 0, 1.5, 0.002, samples=64, seconds=1.0)
    again.finish({"steps": 2})
    assert [(r["step"], r["loss"]) for r in metrics.read_rows(out / "metrics.csv")] == [(1, 2.5), (1, None), (2, 1.5)]


@pytest.mark.parametrize("show, plain", [(True, False), (False, True), (None, True)])  # None: no terminal here
def test_run_log_progress_bar_or_plain_lines(show, plain, tmp_path):
    log = metrics.RunLog(tmp_path / "run", 4, show_progress=show)
    assert log.plain is plain
    log.train_row(1, 0, 2.0, 0.1, samples=8, seconds=1.0)
    log.finish({})


def test_output_dir_check(tmp_path):
    assert metrics.check_output_dir(tmp_path / "new", overwrite=False) == "" and (tmp_path / "new").is_dir()
    (tmp_path / "new" / "metrics.csv").write_text("step\n")
    problem = metrics.check_output_dir(tmp_path / "new", overwrite=False)
    assert problem.startswith(f"output directory {tmp_path / 'new'} already holds a run (metrics.csv)")
    assert "--overwrite" in problem and "--resume auto" in problem
    assert metrics.check_output_dir(tmp_path / "new", overwrite=True) == ""
    assert metrics.check_output_dir(tmp_path / "new", overwrite=False, resume=True) == ""
    (tmp_path / "a-file").write_text("")
    assert metrics.check_output_dir(tmp_path / "a-file" / "run", overwrite=False).startswith(
        f"cannot write to output directory {tmp_path / 'a-file' / 'run'}")


@pytest.mark.parametrize("name, bf16, tf32", [
    ("NVIDIA H100 80GB HBM3", 989.4e12, 494.7e12),  # the SXM part
    ("NVIDIA H100 PCIe", 756.5e12, 378.0e12),
    ("NVIDIA H100 NVL", 835.5e12, 417.5e12),
    ("NVIDIA H200", 989.4e12, 494.7e12),
    ("NVIDIA H200 NVL", 835.5e12, 417.5e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, 156e12),
    ("NVIDIA A100 80GB PCIe", 312e12, 156e12),
    ("NVIDIA H100", None, None),  # which H100? not known exactly: no MFU against a guessed peak
    ("NVIDIA GeForce RTX 4090", None, None),
])
def test_datasheet_peaks_by_exact_part(name, bf16, tf32):
    assert metrics.datasheet_peak(name, torch.bfloat16) == bf16
    assert metrics.datasheet_peak(name, torch.float16) == bf16
    assert metrics.datasheet_peak(name, torch.float32) == tf32
