"""Metrics in one process: the stopwatch, meters, throughput, the matmul probe and datasheet peaks."""
import math
from types import SimpleNamespace

import pytest
import torch

from app.observe import metrics


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


def test_a_weighted_meter_means_by_the_weights_and_counts_samples():
    meter = metrics.Meter(["loss"], torch.device("cpu"))
    meter.add(torch.tensor(2.0), torch.tensor(3.0), loss=torch.tensor(6.0))  # 2 samples weighing 3 in all
    meter.add(torch.tensor(1.0), torch.tensor(1.0), loss=torch.tensor(4.0))
    assert meter.reduce() == {"loss": 2.5, "count": 3.0}


def test_a_meter_of_ranks_that_add_each_sample_alike_counts_it_once():
    """AutoTP's two shards of one replica add the same samples and sums: the means are theirs, the count halved."""
    meter = metrics.Meter(["loss"], torch.device("cpu"), copies=2)
    meter.add(torch.tensor(4.0), loss=torch.tensor(8.0))
    assert meter.reduce() == {"loss": 2.0, "count": 2.0}


def test_throughput_rates():
    assert metrics.Throughput().rates(64, 2.0) == {"samples_per_s": 32.0}
    assert metrics.Throughput().rates(64, 0.0) == {"samples_per_s": 0.0}
    rates = metrics.Throughput(tokens_per_sample=128, flops_per_sample=2e6, peak_flops=4e9).rates(64, 2.0)
    assert rates == {"samples_per_s": 32.0, "tokens_per_s": 32.0 * 128, "mfu": pytest.approx(32.0 * 2e6 / 4e9)}


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


def test_the_matmul_peak_is_measured_once_per_process_for_each_dtype():
    """jobs of one process (the tests' shared launches, the bench's modes) share one measurement per device, dtype
    and thread count; another dtype is measured afresh."""
    import time
    first = metrics.matmul_flops(torch.device("cpu"), torch.float64, seconds=0.05)
    started = time.perf_counter()
    assert metrics.matmul_flops(torch.device("cpu"), torch.float64, seconds=0.05) == first
    assert time.perf_counter() - started < 0.01, "not measured again"
    other = metrics.matmul_flops(torch.device("cpu"), torch.float16, seconds=0.05)
    assert other > 0 and other != first
