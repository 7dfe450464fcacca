"""Export: the fp32 weights of any ZeRO stage's checkpoint, equal to the live model's, loadable without DeepSpeed."""
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from conftest import REPO, assert_one_error_line, run, spawn_ranks


CONFIGS = ["dp", "zero1", "zero2", "zero3", "zero3_offload", "bf16", "bf16-weights"]


def _config(name: str) -> dict:
    """ds_configs/<name>.json; bf16-weights is dp.json with DeepSpeed's own bf16 section (bf16 weights behind an
    fp32 master copy) instead of bf16 autocast (fp32 weights)."""
    from app.ds import config as ds_config
    if name != "bf16-weights":
        return ds_config.load_ds_config(REPO / "ds_configs" / f"{name}.json")
    dp = ds_config.load_ds_config(REPO / "ds_configs" / "dp.json")
    return {**{k: v for k, v in dp.items() if k != "torch_autocast"}, "bf16": {"enabled": True}}


def _save_and_record(rank, world, out):
    """On each rank: train each config 3 steps, save a checkpoint, and keep rank 0's view of the live weights."""
    from app.checkpoint.save import TrainerState, save_checkpoint
    from app.ds import precision
    from app import settings as config
    from app.distributed import dist
    from app.ds import config as ds_config
    from app.distributed import launch
    from conftest import engine_of
    from app.core import models
    from app.core import tasks
    from app.data import DataInfo
    launch.prepare_environment()
    # loaded before the group exists, as the app does: DeepSpeed's own check then counts one rank
    configs = {name: _config(name) for name in CONFIGS}
    launch.setup(timeout_s=120)
    import deepspeed
    info = DataInfo(10, 1, 8)
    for name in CONFIGS:
        torch.manual_seed(0)
        ds = ds_config.resolve_batch_sizes(configs[name], world, name)
        engine = engine_of(models.build_model("cnn", info), ds_config.fill_scheduler_length(ds, 10))
        for step in range(3):
            gen = torch.Generator().manual_seed(step * world + rank)
            x = torch.randn(8, 1, 8, 8, generator=gen).to(precision.input_dtype(engine))
            y = torch.randint(0, 10, (8,), generator=gen)
            engine.backward(tasks.class_loss(engine(x), y).mean())
            engine.step()
        state = TrainerState(step=3, epoch=0, batch=3, model="cnn", dataset="digits", world_size=world,
                             zero_stage=ds_config.zero_stage(ds), settings=asdict(config.Settings()),
                             data_info=asdict(info), deepspeed_config=ds)
        save_checkpoint(engine, out / name, state, keep_last=0)
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=ds_config.zero_stage(ds) == 3):
            live = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        if rank == 0:
            torch.save(live, out / name / "live.pt")
    dist.teardown()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    spawn_ranks(2, _save_and_record, out)
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_exported_weights_equal_the_live_weights(name, saved, tmp_path):
    folder, target = saved / name / "checkpoints" / "step00000003", tmp_path / f"{name}.safetensors"
    result = run([sys.executable, "-m", "app.tools.export", folder, target])
    assert result.returncode == 0, result.stderr
    from safetensors.torch import load_file
    exported, live = load_file(target), torch.load(saved / name / "live.pt")
    assert exported.keys() == live.keys()
    for key, tensor in exported.items():
        assert tensor.dtype == torch.float32
        if name == "bf16-weights":  # the engine computes with bf16 copies of the exported fp32 master weights
            assert torch.equal(tensor.to(torch.bfloat16), live[key]), key
        else:
            assert torch.equal(tensor, live[key]), key


def test_export_loads_without_deepspeed(saved, tmp_path):
    target = tmp_path / "cnn.safetensors"
    assert run([sys.executable, "-m", "app.tools.export", saved / "zero3" / "checkpoints" / "step00000003", target]
               ).returncode == 0
    script = (
        "import sys, json; sys.modules['deepspeed'] = None\n"  # any import of deepspeed now fails
        "from safetensors import safe_open\n"
        "from safetensors.torch import load_file\n"
        "from app.data import DataInfo\n"
        "from app.core.models import build_model\n"
        f"meta = safe_open({str(target)!r}, 'pt').metadata()\n"
        "model = build_model(json.loads(meta['model']), DataInfo(**json.loads(meta['data_info'])))\n"
        f"model.load_state_dict(load_file({str(target)!r}), strict=True)\n"
        "print('loaded', sum(p.numel() for p in model.parameters()))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("loaded "), result.stderr


def test_export_refuses_to_overwrite_and_non_checkpoints(saved, tmp_path):
    target = tmp_path / "keep.safetensors"
    target.write_text("mine")
    result = run([sys.executable, "-m", "app.tools.export", saved / "dp" / "checkpoints" / "step00000003", target])
    assert result.returncode != 0 and target.read_text() == "mine"
    assert_one_error_line(result.stderr, "already exists")
    result = run([sys.executable, "-m", "app.tools.export", tmp_path, tmp_path / "x.safetensors"])
    assert result.returncode != 0
    assert_one_error_line(result.stderr, "is not a complete checkpoint")


def test_export_takes_a_run_folder_and_names_a_damaged_manifest(saved, tmp_path):
    result = run([sys.executable, "-m", "app.tools.export", saved / "zero1", tmp_path / "run.safetensors"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"exporting the newest complete checkpoint of {saved / 'zero1'}: step00000003")
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", str(saved / "dp"), str(damaged)], check=True)
    manifest = damaged / "checkpoints" / "step00000003" / "manifest.json"
    manifest.write_text(manifest.read_text()[:50])
    result = run([sys.executable, "-m", "app.tools.export", damaged, tmp_path / "x.safetensors"])
    assert result.returncode == 2 and not (tmp_path / "x.safetensors").exists()
    assert_one_error_line(result.stderr, "is damaged: manifest.json cannot be read", "start a new --output_dir")
