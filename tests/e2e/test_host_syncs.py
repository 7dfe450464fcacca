"""No training step of the app's waits on the device, and DeepSpeed's own waits are stock DeepSpeed's: host
synchronisations counted per step (tests/helpers/host_syncs.py), the app's and DeepSpeed's, for every shipped
ds_config in the precision it takes on a GPU (bf16), eager and compiled, on 1 and 2 ranks."""
import pytest

from app.tools.instructions import write_model
from conftest import write_text_rows
from helpers.host_syncs import STEPS, check_preference_waits, check_report, count_in_launch, counted, sync_job

# bf16.json is dp.json with bf16 autocast on everywhere: as a GPU resolves them, the same run, counted once
CONFIGS = ("dp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "activation_checkpointing")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_text_rows(tmp_path_factory.mktemp("text") / "corpus.txt", 600)


def test_no_step_waits_on_the_device_with_two_ranks(tmp_path, corpus):
    names = [(name, mode) for mode in ("off", "on") for name in CONFIGS + ("pipeline",)
             if not (name == "pipeline" and mode == "on")]  # pipeline stages run eager
    jobs = [sync_job(name, mode, tmp_path / f"{name}-{mode}") for name, mode in names]
    # tensor parallelism on a small Llama folder (1 layer, 320 tokens): what a step waits on does not grow with
    # the model, and bf16 matmuls are slow on a CPU without bf16 instructions
    llama = ["--model", write_model(tmp_path, seed=0, layers=1), "--dataset", corpus, "--block_size", 32]
    jobs += [sync_job("tensor_parallel", mode, tmp_path / f"tp-{mode}", *llama) for mode in ("off", "on")]
    reports = count_in_launch(2, jobs)
    for (name, mode), report in zip(names, reports):
        assert "precision: bf16 autocast" in report["output"], report["output"][-2000:]
        assert ("compile: compiling" in report["output"]) == (mode == "on")
        check_report(name, report)
    eager, compiled = reports[-2:]
    check_report("tensor_parallel", compiled)
    # eager, transformers' own masking code asks once per forward whether the rows are packed sequences
    model_only = {source.split(" at ")[1].split(":")[0] for _, _, source, _ in counted(eager)}
    assert model_only == {"transformers/masking_utils.py"}, counted(eager)
    assert all(count == 1 for _, _, _, count in counted(eager))


def test_no_sequence_parallel_or_tiled_step_waits_on_the_device(tmp_path):
    """DeepSpeed's Ulysses (sequence_parallel.json: 2 ranks share each sequence) with the tiled MLPs and loss that
    come with it, and --tiled on under ZeRO 0 on 2 ranks, eager, on a small Llama folder: the only waits are the
    model's own, transformers' masking code asking once per forward whether the rows are packed sequences."""
    rows = write_text_rows(tmp_path / "corpus.txt", 3000)  # no epoch ends inside the counted steps
    llama = ["--model", write_model(tmp_path, seed=0, layers=1), "--dataset", rows, "--block_size", 64]
    names = {"sequence parallel": ("sequence_parallel",), "tiled": ("dp", "--tiled", "on")}
    jobs = [sync_job(name, "off", tmp_path / label.replace(" ", "-"), *llama, *extra)
            for label, (name, *extra) in names.items()]
    for label, report in zip(names, count_in_launch(2, jobs)):
        assert report["code"] == 0 and "tiled: " in report["output"], report["output"][-2000:]
        assert ("DeepSpeed Ulysses splits each sequence over 2 ranks" in report["output"]) == (label != "tiled")
        assert all(len(windows) == STEPS - 2 for windows in report["ranks"]), report["ranks"]
        found = counted(report)
        assert {source.split(" at ")[1].split(":")[0] for _, _, source, _ in found} <= \
            {"transformers/masking_utils.py"}, (label, found)
        assert all(count == 1 for _, _, _, count in found), (label, found)


def test_no_preference_step_waits_on_the_device(tmp_path):
    """Preference pairs on 2 ranks, eager, against each reference: a frozen copy (ZeRO 0 and 2), the adapters off
    (LoRA), precomputed (ZeRO 1). The only waits are the model's own: transformers' masking code asks once per
    forward whether the rows are packed, the model's forward and the reference's."""
    check_preference_waits(tmp_path)


def test_no_step_waits_on_the_device_with_one_rank(tmp_path):
    """One rank on one thread, as each of the 2 ranks above has: inductor's CPU kernels depend on the thread count,
    so the compiled jobs reuse the kernels the 2-rank jobs built."""
    names = [(name, mode) for mode in ("off", "on") for name in CONFIGS]
    jobs = [sync_job(name, mode, tmp_path / f"{name}-{mode}") for name, mode in names]
    reports = count_in_launch(1, jobs, OMP_NUM_THREADS="1")
    for (name, mode), report in zip(names, reports):
        check_report(name, report)


def test_no_step_waits_on_the_device_with_bf16_weights(tmp_path):
    """DeepSpeed's "bf16" section (16-bit weights, fp32 masters) under ZeRO 0-3 on 2 ranks, eager: no step waits,
    though DeepSpeed checks bf16 gradients for overflow by default (check_grad_overflow) and ZeRO 0's optimizer
    wrapper reads each gradient's overflow flag and norm on the host."""
    import json
    from conftest import REPO
    jobs = []
    for stage in range(4):
        ds = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
        ds.pop("torch_autocast")
        ds.update(bf16={"enabled": True}, zero_optimization={"stage": stage})
        path = tmp_path / f"bf16-zero{stage}.json"
        path.write_text(json.dumps(ds))
        jobs.append([*sync_job("dp", "off", tmp_path / f"run{stage}")[2:], "--deepspeed_config", path])
    reports = count_in_launch(2, jobs)
    for report in reports:
        assert "precision: bf16" in report["output"] and "precision: bf16 autocast" not in report["output"]
    for stage, report in enumerate(reports):
        check_report(f"bf16 zero{stage}", report)


def _nan_step_skipped(rank, world, stage):
    """Under the bf16 section at a ZeRO stage: a step whose gradients hold NaN leaves the weights as they were
    (the check that moved to the device still skips it); the next, finite step moves them."""
    import torch
    from conftest import engine_of
    from app.distributed import dist, launch
    launch.prepare_environment()
    launch.setup(timeout_s=60)
    try:
        torch.manual_seed(0)
        ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2 * world,
              "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "fused": True, "lr": 0.1}}}
        engine = engine_of(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)), ds)
        before = [p.detach().clone() for p in engine.module.parameters()]
        for x, moved in ((torch.full((2, 8), float("nan")), False), (torch.ones(2, 8), True)):
            engine.backward(engine(x.to(engine.device, torch.bfloat16)).float().sum())
            engine.step()
            after = [p.detach().clone() for p in engine.module.parameters()]
            assert any(not torch.equal(a, b) for a, b in zip(before, after)) == moved, (stage, x[0, 0])
            assert all(torch.isfinite(p).all() for p in after)
            before = after
    finally:
        dist.teardown()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_step_of_nan_gradients_is_skipped_under_bf16(stage):
    from conftest import spawn_ranks
    spawn_ranks(2, _nan_step_skipped, stage)


def _bf16_zero0_steps_as_deepspeed_does(rank, world):
    """The app's device-side ZeRO 0 bf16 step against DeepSpeed's own (FP16_UnfusedOptimizer.step), from the same
    weights over the same batches, clipping on: the same fp32 masters and bf16 weights."""
    import types
    import torch
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from conftest import engine_of
    from app.distributed import dist, launch
    launch.prepare_environment()
    launch.setup(timeout_s=60)
    try:
        ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 4 * world,
              "gradient_clipping": 0.5, "bf16": {"enabled": True}, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "fused": True, "lr": 0.05}}}
        engines = []
        for ours in (True, False):
            torch.manual_seed(0)
            engines.append(engine_of(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                                                 torch.nn.Linear(32, 1)), ds))
            if not ours:
                engines[-1].optimizer.step = types.MethodType(FP16_UnfusedOptimizer.step, engines[-1].optimizer)
        torch.manual_seed(1 + rank)
        for _ in range(4):
            x = torch.randn(4, 16)
            for engine in engines:
                engine.backward(engine(x.to(engine.device, torch.bfloat16)).float().pow(2).sum())
                engine.step()
        ours, theirs = ([p for group in e.optimizer.fp32_groups for p in group] for e in engines)
        assert max((a - b).abs().max().item() for a, b in zip(ours, theirs)) < 1e-6
        assert all(torch.equal(a, b) for a, b in zip(engines[0].module.parameters(), engines[1].module.parameters()))
    finally:
        dist.teardown()


def test_bf16_weights_under_zero0_step_as_deepspeed_does_without_waiting():
    from conftest import spawn_ranks
    spawn_ranks(2, _bf16_zero0_steps_as_deepspeed_does)
