"""What every mode of the benchmark builds on, in one process: the clock, the timed loader, the parameter bytes, the
model its FLOPs are counted on."""
import time

import torch

from app.data.loader import build_loader
from app.tools import bench_common

CPU = torch.device("cpu")


def test_the_clock_gives_one_time_per_step_from_the_mark_before_it():
    clock = bench_common.Clock(CPU)
    for pause in (0.03, 0.0, 0.01):
        time.sleep(pause)
        clock.tick()
    times = clock.times()
    assert len(times) == 3 and min(times) >= 0
    assert times[0] >= 0.03 and times[2] >= 0.01 and times[1] < times[0]


def test_the_timed_loader_counts_each_wait_and_ends_with_its_loader():
    loader = build_loader(torch.utils.data.TensorDataset(torch.arange(12.0), torch.arange(12)), 4, 0, 1, True, 0)
    clock = bench_common.Clock(CPU)
    timed = bench_common.TimedLoader(loader, clock)
    batches = list(timed)
    assert len(timed) == len(loader) == len(batches) == 3
    timed.set_epoch(1, 2)
    assert (loader.batch_sampler.epoch, loader.batch_sampler.skip) == (1, 2), "the loop's calls reach the loader"
    assert timed.total_units() == 12.0 and timed.drawn(1, 2) == {}
    assert len(clock.waits) == 3, "one wait per batch: the i-th is the i-th step's"
    assert sorted(torch.cat([x for x, _, _ in batches]).tolist()) == [float(i) for i in range(12)]


def test_an_endless_timed_loader_goes_on_into_a_new_epoch_in_a_new_order():
    loader = build_loader(torch.utils.data.TensorDataset(torch.arange(64.0), torch.arange(64)), 32, 0, 1, True, 0)
    clock = bench_common.Clock(CPU)
    batches = iter(bench_common.TimedLoader(loader, clock, endless=True))
    epochs = [torch.cat([next(batches)[0] for _ in range(2)]).tolist() for _ in range(3)]
    assert len(clock.waits) == 6, "an epoch's end adds no wait: the i-th is still the i-th step's"
    assert all(sorted(epoch) == [float(i) for i in range(64)] for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2], "each epoch shuffled by its own number"


def test_parameter_bytes_count_each_dtype_and_a_zero3_rank_only_its_partition():
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).to(torch.bfloat16))
    assert bench_common.param_bytes(module) == (4 * 3 + 3) * 4 + (3 * 2 + 2) * 2
    module[0].weight.ds_tensor = torch.empty(5)  # what ZeRO-3 leaves: the rank's partition beside an empty weight
    assert bench_common.param_bytes(module) == (5 + 3) * 4 + (3 * 2 + 2) * 2


def test_a_folders_model_is_counted_from_its_config_without_reading_its_weights(tmp_path):
    """The benchmark counts a save_pretrained folder's model on the meta device, which transformers refuses to load
    weights onto: from its config.json, the same parameters, and the folder is still the runs' source after."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from app.core import resolver
    from app.settings import Settings
    from app.tools.bench_common import Workload, counted_model
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=256)).save_pretrained(
        tmp_path)
    task = resolver.build(Settings(model=str(tmp_path)))
    train_set, info = task.sample_data(4, 32)
    model = counted_model(Workload(task, train_set, info))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in GPT2LMHeadModel.from_pretrained(tmp_path).parameters())
    assert task.spec.pretrained == str(tmp_path)


def test_the_measured_steps_are_those_after_the_warm_up_and_none_after_them():
    """5 steps: 2 warm-up (the first, with its compile, among them), 2 measured, then 1 profiled: steps 3 and 4."""
    clock = bench_common.Clock(CPU)
    for pause in (0.05, 0.0, 0.02, 0.03, 0.2):
        time.sleep(pause)
        clock.waits.append(pause)
        clock.tick()
    first, times, waits = clock.measured(2, 2)
    assert first >= 0.05 and len(times) == 2 and waits == [0.02, 0.03]
    assert 0.02 <= times[0] < 0.1 and 0.03 <= times[1] < 0.15, "neither the first nor the profiled step"
    assert len(clock.measured(0, 1)[1]) == 1, "--steps 1 --warmup 0 measures one step"
