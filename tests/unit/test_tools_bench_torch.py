"""The benchmark's torch modes in this process: the hand-written loop and the raw mode built on it. DDP and FSDP2 on
two ranks, against the same loop: tests/e2e/test_tools_bench.py."""
import torch

from app.data.loader import build_loader
from app.distributed.dist import World
from app.tools import bench, bench_modes, bench_torch

CPU = torch.device("cpu")


def _setup():
    args = bench.parse(["--quick", "--batch", "8", "--modes", "raw"])
    work = bench_modes.build_workload(args)
    return args, work, build_loader(work.train_set, 8, 0, 1, True, 0), bench_modes.Clock(CPU)


def test_the_loop_runs_its_steps_one_tick_each_and_learns():
    args, work, loader, clock = _setup()
    model = bench_modes.build_model(work)
    losses = bench_torch.train(model, model, False, args, World(0, 0, 1, 1, CPU, "gloo", "python", ""), work, loader,
                               clock, 6)
    assert len(losses) == 6 and all(loss.shape == () and not loss.requires_grad for loss in losses)
    assert len(clock.times()) == 6 and len(clock.waits) >= 6, "a tick and a timed batch per step"
    assert losses[-1] < losses[0], "AdamW at the reference config's rate lowers the loss"


def test_the_raw_mode_trains_the_whole_fp32_model_eager():
    args, work, loader, clock = _setup()
    zero, dtype, compiled, held = bench_torch.run_torch("raw", args, World(0, 0, 1, 1, CPU, "gloo", "python", ""),
                                                        work, loader, clock, 2)
    whole = sum(p.numel() * 4 for p in bench_modes.build_model(work).parameters())
    assert (zero, dtype, compiled, held) == (None, torch.float32, False, whole)


def test_the_loop_takes_its_optimizer_from_an_accelerate_file_as_a_run_fills_it():
    """An accelerate file names no optimizer and leaves the clipping "auto": the torch modes take the app's default
    AdamW and clipping, as a run of the file would."""
    from conftest import REPO
    trl = REPO / "tests" / "data" / "accelerate" / "trl-deepspeed_zero2.yaml"
    args = bench.parse(["--quick", "--batch", "8", "--modes", "raw,app", "--configs", str(trl), "--ranks", "1"])
    from app.ds import auto as ds_auto
    assert args.reference["gradient_clipping"] == 1.0
    assert args.reference["optimizer"]["type"] == "AdamW"
    assert args.reference["optimizer"]["params"]["lr"] == ds_auto.LR_SCRATCH
    work = bench_modes.build_workload(args)
    model = bench_modes.build_model(work)
    before = [p.detach().clone() for p in model.parameters()]
    losses = bench_torch.train(model, model, False, args, World(0, 0, 1, 1, CPU, "gloo", "python", ""), work,
                               build_loader(work.train_set, 8, 0, 1, True, 0), bench_modes.Clock(CPU), 4)
    assert len(losses) == 4 and all(torch.isfinite(loss) for loss in losses)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters())), "AdamW stepped every weight"
