"""The memory plan against a real engine: the reduce buckets DeepSpeed allocates, in the dtypes torch_autocast
gives them. The plan's arithmetic: tests/unit/test_plan.py; its model states against a real engine's:
tests/e2e/test_tools_bench.py."""
import json

from app.memory import estimate
from conftest import REPO


def _buckets_deepspeed_allocates(rank, world, cases, report):
    """Bytes of the reduce buckets a real engine allocates (ZeRO 1-2: during backward; ZeRO-3: at start) for each
    (config, torch_autocast section) in cases, with the plan's figure beside it."""
    import torch
    from app.distributed import launch
    from conftest import engine_of
    launch.prepare_environment()
    launch.setup(timeout_s=60)
    found = []
    for name, autocast in cases:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
        ds = {**json.loads((REPO / "ds_configs" / f"{name}.json").read_text()), "torch_autocast": autocast}
        ds.pop("scheduler")
        total, kinds = sum(p.numel() for p in model.parameters()), estimate.comm_kinds(model)  # before ZeRO-3 splits them
        engine = engine_of(model, ds)
        held = []
        if engine.zero_optimization_stage() < 3:
            setup = engine.optimizer.setup_buckets
            engine.optimizer.setup_buckets = lambda: (setup(), held.append(_ipg_bytes(engine.optimizer)))[0]
            engine.backward(engine(torch.randn(4, 8)).float().sum())
        else:
            held.append(_ipg_bytes(engine.optimizer))
        found.append([held[0], estimate.bucket_bytes(total, ds, kinds)])
        engine.destroy()
    report.write_text(json.dumps(found))


def _ipg_bytes(optimizer) -> int:
    buffers = [b for bucket in optimizer.ipg_buckets.values() for b in
               (bucket.buffer if isinstance(bucket.buffer, list) else [bucket.buffer])]
    return sum(b.numel() * b.element_size() for b in buffers)


def test_the_plan_counts_the_reduce_buckets_deepspeed_allocates(tmp_path):
    """Under torch_autocast, Linear weights reduce in bf16 and the rest in fp32: a bucket each, whole buckets of
    reduce_bucket_size (capped at the model's size when unset); overlap doubles ZeRO 1-2's; the shipped configs'
    "lower_precision_safe_modules": [] reduces everything in fp32, in one."""
    from conftest import spawn_ranks
    default = {"enabled": True, "dtype": "bfloat16"}
    fp32 = {**default, "lower_precision_safe_modules": []}
    cases = [("zero1", default), ("zero2", default), ("zero2", fp32), ("zero3", default), ("zero3", fp32)]
    report = tmp_path / "buckets.json"
    spawn_ranks(1, _buckets_deepspeed_allocates, cases, report)
    found = json.loads(report.read_text())
    for (name, autocast), (held, planned) in zip(cases, found):
        assert held == planned, (name, autocast, held, planned)
    total = 8 * 16 + 16 + 2 * 16 + 16 * 4 + 4
    assert [held for held, _ in found] == [8 * total, 8 * total, 4 * total, 6 * total, 4 * total]
