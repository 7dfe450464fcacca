"""The app's changes to DeepSpeed's step (app/ds/internals/) against stock DeepSpeed, in one process group: for each
case (ZeRO stage, precision section), a small model stepped by stock DeepSpeed, then by the app's engine, over the
same batches with the gradients of step BAD made NaN. Each rank writes what it saw (learning rates, skipped steps,
the largest difference of its weights); the tests (test_stock_deepspeed.py on CPU, test_cuda.py on a GPU) judge it.

    deepspeed --num_gpus 2 tests/helpers/stock_steps.py <report folder> <stage>:<fp32|bf16>:<reads every N steps> ...
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STEPS, BAD = 6, 3  # the gradients of step 3 are NaN (BAD 0: none are)


def config(world: int, stage: int, section: str) -> dict:
    """A clipped fused AdamW under a warm-up, so that a skipped step shows in the learning rate."""
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 4 * world,
          "gradient_clipping": 0.5, "zero_optimization": {"stage": stage},
          "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "fused": True, "lr": 0.05}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_min_lr": 0,
                                                        "warmup_max_lr": 0.05, "warmup_type": "linear"}}}
    if section == "bf16":
        ds["bf16"] = {"enabled": True}
    return ds


def build(ds: dict, ours: bool):
    """The same small model from the same seed, in the app's engine (tests/helpers/engines.py) or stock DeepSpeed's."""
    import deepspeed
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    if ours:
        from tests.helpers.engines import engine_of
        return engine_of(model, ds)
    return deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)[0]


def train(engine, rank: int, reads_every: int, bad: int) -> dict:
    """STEPS steps (NaN gradients at step `bad`): the learning rate after each, the weights this rank holds (and the
    fp32 masters of ZeRO 0's bf16 wrapper), the skipped steps. reads_every > 0: the app's loop reads its Divergence
    that often (stock DeepSpeed has none)."""
    import torch
    from app.core.divergence import Divergence
    from app.ds.internals import held_weights
    divergence = Divergence(engine, 0) if reads_every else None
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    generator, rates = torch.Generator().manual_seed(1 + rank), []
    for step in range(1, STEPS + 1):
        out = engine(torch.randn(4, 16, generator=generator).to(engine.device, dtype)).float()
        if step == bad:
            out.register_hook(lambda grad: grad * float("nan"))
        engine.backward(out.pow(2).sum())
        engine.step()
        if divergence is not None:
            divergence.stepped(torch.zeros((), dtype=torch.bool, device=engine.device))
            if step % reads_every == 0:
                divergence.check()
        rates.append(engine.get_lr()[0])
    masters = getattr(engine.optimizer, "fp32_groups", None) or []
    return {"rates": rates, "skipped": engine.skipped_steps,
            "weights": [t.detach().float().cpu().clone() for t in held_weights(engine)],
            "masters": [p.detach().float().cpu().clone() for group in masters for p in group]}


def compare(rank: int, world: int, stage: int, section: str, reads_every: int) -> dict:
    """Stock DeepSpeed first (before the app's changes are installed in this process), then the app's engine."""
    bad = BAD if (stage, section) != (0, "fp32") else 0  # ZeRO 0 in fp32 applies a NaN step, as DeepSpeed does
    ds = config(world, stage, section)
    stock = train(build(ds, ours=False), rank, 0, bad)
    ours = train(build(ds, ours=True), rank, reads_every, bad)

    def largest(a, b):
        return max(((x - y).abs().max().item() for x, y in zip(a, b) if x.numel()), default=0.0)
    return {"stock_rates": stock["rates"], "rates": ours["rates"], "stock_skipped": stock["skipped"],
            "skipped": ours["skipped"], "weights": largest(ours["weights"], stock["weights"]),
            "masters": largest(ours["masters"], stock["masters"]),
            "finite": all(bool(t.isfinite().all()) for t in ours["weights"])}


def judge(case: str, seen: dict, tolerance: float = 0.0):
    """Assert what a rank saw in a case: the NaN step skipped and counted as stock DeepSpeed counts it, the same
    learning rates (read every step) or the same once read (read less often), the same weights (within tolerance;
    the bf16 section at ZeRO 0 sums its norm's squares in another order: its fp32 masters within 1e-6)."""
    stage, section, reads = case.split(":")
    if (stage, section) != ("0", "fp32"):
        assert seen["skipped"] == seen["stock_skipped"] == 1, (case, seen["skipped"], seen["stock_skipped"])
        assert seen["finite"], case
    if reads == "1":
        assert seen["rates"] == seen["stock_rates"], (case, seen["rates"], seen["stock_rates"])
    else:  # ahead of the schedule from the skipped step to the read, the same after it
        assert seen["rates"][-1] == seen["stock_rates"][-1] and seen["rates"][BAD - 1] > seen["stock_rates"][BAD - 1]
    if (stage, section) == ("0", "bf16"):
        assert seen["masters"] < 1e-6, (case, seen["masters"])
    elif reads == "1":
        assert seen["weights"] <= tolerance, (case, seen["weights"])


def cases_in(report: str, cases: list, world: int) -> list:
    """(case, what rank r saw) for every case and rank, from a report folder."""
    return [(case, json.loads(Path(report, f"{case.replace(':', '-')}.rank{rank}.json").read_text()))
            for case in cases for rank in range(world)]


def bf16_weights_config(folder: Path, stage: int) -> Path:
    """ds_configs/zero3.json with DeepSpeed's "bf16" section (16-bit weights) in place of autocast, at a stage."""
    repo = Path(__file__).resolve().parents[2]
    ds = json.loads((repo / "ds_configs" / "zero3.json").read_text())
    ds.pop("torch_autocast")
    ds.update(bf16={"enabled": True}, zero_optimization={"stage": stage})
    path = folder / f"bf16-zero{stage}.json"
    path.write_text(json.dumps(ds))
    return path


def losses_against_stock(folder: Path, configs: dict, args: list, nproc: int = 1, base_env=None) -> dict:
    """name -> the largest relative difference of a run's per-step losses from the same run on stock DeepSpeed
    (tests/helpers/stock_deepspeed.py), for each of configs (name -> ds_config path); both runs must train."""
    from conftest import read_metrics, train_jobs
    runs = {}
    for label, wrapper in (("app", ()), ("stock", ("tests/helpers/stock_deepspeed.py",))):
        jobs = [["--deepspeed_config", path, "--log_interval", 1, *args, "--output_dir", folder / f"{name}-{label}"]
                for name, path in configs.items()]
        train_jobs("ranks", nproc, jobs, base_env=base_env, wrapper=wrapper)
    for name in configs:
        ours, stock = ([r["loss"] for r in read_metrics(folder / f"{name}-{label}")[0]] for label in ("app", "stock"))
        assert len(ours) == len(stock) > 0 and ours[-1] < ours[0], (name, ours, stock)
        runs[name] = max(abs(a - b) / abs(b) for a, b in zip(ours, stock))
    return runs


def main(report: str, *cases):
    from app.distributed import dist, launch
    launch.prepare_environment()
    world = launch.setup(timeout_s=120)
    try:
        for case in cases:
            stage, section, reads = case.split(":")
            seen = compare(world.rank, world.world_size, int(stage), section, int(reads))
            Path(report, f"{case.replace(':', '-')}.rank{world.rank}.json").write_text(json.dumps(seen))
    finally:
        dist.teardown()


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
    from app import train as _train
    _train.exit_now(0)
