"""The DeepSpeed JSON is checked strictly, batch sizes follow the world size, ds_configs/ stay honest."""
import json

import pytest
import torch

from app.ds import config as ds_config
from app.ds import precision
from app.errors import UserError
from conftest import REPO

CONFIG_FILES = sorted((REPO / "ds_configs").glob("*.json"))


def _load(tmp_path, ds):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(ds))
    return ds_config.load_ds_config(path)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_shipped_configs_load_and_follow_the_world_size(path):
    ds = ds_config.load_ds_config(path)
    assert "train_batch_size" not in ds, "leave train_batch_size out so the file works at any world size"
    assert ds["train_micro_batch_size_per_gpu"] >= 1 and ds["gradient_accumulation_steps"] >= 1
    assert ds["optimizer"]["type"] and ds["scheduler"]["params"]["warmup_num_steps"] > 0
    assert ds["gradient_clipping"] > 0
    for world in (1, 2, 3, 8):
        assert ds_config.resolve_batch_sizes(ds, world, path.name)["train_batch_size"] == \
            ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world


def _differences(a: dict, b: dict, prefix=""):
    keys = set(a) | set(b)
    out = set()
    for key in keys:
        if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
            out |= _differences(a[key], b[key], f"{prefix}{key}.")
        elif a.get(key) != b.get(key):
            out.add(prefix + key)
    return out


@pytest.mark.parametrize("name, base, allowed", [
    ("zero1", "dp", {"zero_optimization.stage"}),
    ("zero2", "dp", {"zero_optimization.stage", "zero_optimization.overlap_comm",
                     "zero_optimization.contiguous_gradients"}),
    # ZeRO-3 overlaps its gathers and reductions with compute (DeepSpeed's default for stage 3); ZeRO-2's overlap
    # would make the host wait for the device at the end of every backward (README, the ds_configs table); and
    # DeepSpeed's own ZeRO-3 settings: leaf blocks, a prefetch of one block, persistence by device (docs/configs.md)
    ("zero3", "zero2", {"zero_optimization.stage", "zero_optimization.overlap_comm", "zero_optimization.leaf_module",
                        "zero_optimization.stage3_prefetch_bucket_size",
                        "zero_optimization.stage3_param_persistence_threshold"}),
    # offload runs the step in DeepSpeed's CPU Adam, so those files cannot ask for torch's (fused) AdamW
    ("zero2_offload", "zero2", {"zero_optimization.offload_optimizer", "zero_optimization.overlap_comm",
                                "optimizer.params.torch_adam", "optimizer.params.fused"}),
    ("zero3_offload", "zero3", {"zero_optimization.offload_optimizer", "zero_optimization.offload_param",
                                "zero_optimization.overlap_comm", "optimizer.params.torch_adam",
                                "optimizer.params.fused"}),
    ("bf16", "dp", {"torch_autocast.enabled"}),  # bf16 autocast always; the others "auto": on GPUs that have bf16
    ("pipeline", "dp", {"pipeline"}),  # 2 stages, layers balanced by parameters
    ("activation_checkpointing", "dp", {"activation_checkpointing"}),  # every model's blocks recompute
    ("tensor_parallel", "dp", {"tensor_parallel"}),  # AutoTP across 2 ranks
])
def test_configs_differ_only_in_what_their_names_promise(name, base, allowed):
    read = lambda n: json.loads((REPO / "ds_configs" / f"{n}.json").read_text())  # noqa: E731
    assert _differences(read(name), read(base)) <= allowed


def test_unknown_key_inside_a_section_read_key_by_key(tmp_path):
    ds = json.loads((REPO / "ds_configs" / "dp.json").read_text())
    ds["flops_profiler"] = {"enabled": False, "profile_stepp": 3}
    with pytest.raises(UserError, match=r"flops_profiler.profile_stepp.*did you mean 'profile_step'"):
        _load(tmp_path, ds)


@pytest.mark.parametrize("section, value, said", [
    ("zero_optimization", {"stage": 2, "overlap_com": True}, "zero_optimization.overlap_com: .*'overlap_comm'"),
    ("zero_optimization", {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memry": True}},
     "zero_optimization.offload_optimizer.pin_memry: .*did you mean 'pin_memory'"),
    ("zero_optimization", {"stage": 3, "offload_param": {"device": "cpu", "buffer_cont": 4}},
     "zero_optimization.offload_param.buffer_cont: .*did you mean 'buffer_count'"),
    ("tensor_parallel", {"autotp_sise": 2}, "tensor_parallel.autotp_sise: .*did you mean 'autotp_size'"),
])
def test_a_misspelled_key_deep_in_a_section_deepspeed_checks_gets_the_name_it_meant(section, value, said, tmp_path):
    ds = {**json.loads((REPO / "ds_configs" / "dp.json").read_text()), section: value}
    with pytest.raises(UserError, match=said):
        _load(tmp_path, ds)


@pytest.mark.parametrize("key, meant", [("optimiser", "optimizer"), ("schedular", "scheduler"),
                                        ("activation_checkpoint", "activation_checkpointing")])
def test_a_misspelled_section_deepspeed_looks_for_by_name_is_one_line_not_the_apps_default(key, meant, tmp_path):
    """DeepSpeed asks `"optimizer" in param_dict.keys()`: the section a typo hides would be replaced by the app's
    own (its AdamW and cosine schedule), or dropped (no checkpointing), after a warning alone."""
    ds = {"train_micro_batch_size_per_gpu": 1, key: {"type": "AdamW", "params": {"lr": 3e-4}}}
    with pytest.raises(UserError, match=f"unknown DeepSpeed key '{key}' \\(did you mean '{meant}'\\?\\)"):
        _load(tmp_path, ds)


def test_a_check_of_a_whole_section_is_deepspeeds_own_line(tmp_path):
    """Partial offload under ZeRO 2: DeepSpeed's validator of the whole section names no one key."""
    ds = {"train_micro_batch_size_per_gpu": 1,
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
    with pytest.raises(UserError, match=r"DeepSpeed rejected the config \(DeepSpeedZeroConfig\): .*Partial "
                                        r"offloading only supported for ZeRO Stage 3"):
        _load(tmp_path, ds)


def test_known_sections_pass(tmp_path):
    ds = json.loads((REPO / "ds_configs" / "zero3_offload.json").read_text())
    ds.update(fp16={"enabled": False, "loss_scale": 0}, flops_profiler={"enabled": False, "profile_step": 2},
              tensorboard={"enabled": False, "output_path": "x"}, wall_clock_breakdown=False)
    assert _load(tmp_path, ds)["flops_profiler"]["profile_step"] == 2


def test_top_level_must_be_an_object(tmp_path):
    with pytest.raises(UserError, match="JSON object"):
        _load(tmp_path, [1, 2])


@pytest.mark.parametrize("name", ["ds.json", "accelerate.yaml"])
def test_a_file_that_is_not_text_is_one_line_json_or_yaml(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"\x80\x81zero_stage\xff: 3\n")
    with pytest.raises(UserError, match=r"is not a text file \(not UTF-8\): pass the DeepSpeed JSON file"):
        ds_config.load_ds_config(path)


@pytest.mark.parametrize("ds, world, expect", [
    ({"train_micro_batch_size_per_gpu": 4}, 2, (4, 1, 8)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (4, 3, 24)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (8, 2, 32)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (4, 4, 32)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (4, 3, 24)),
])
def test_batch_sizes_resolve(ds, world, expect):
    got = ds_config.resolve_batch_sizes(ds, world, "x.json")
    assert (got["train_micro_batch_size_per_gpu"], got["gradient_accumulation_steps"], got["train_batch_size"]) == expect


@pytest.mark.parametrize("ds, world, message", [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2, "multiple of 8"),
    ({"train_batch_size": 30, "gradient_accumulation_steps": 4}, 2, "not divisible"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2,
     "train_batch_size 64 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x data-parallel ranks 2 = 16"),
])
def test_batch_sizes_that_cannot_agree(ds, world, message):
    with pytest.raises(UserError, match=message.replace(".", r"\.")):
        ds_config.resolve_batch_sizes(ds, world, "x.json")


def test_scheduler_length_comes_from_the_run_unless_set():
    ds = {"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5}}}
    assert ds_config.fill_scheduler_length(ds, 77)["scheduler"]["params"]["total_num_steps"] == 77
    ds = {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}}
    assert ds_config.fill_scheduler_length(ds, 77)["scheduler"]["params"]["total_num_steps"] == 10
    ds = {"scheduler": {"type": "WarmupLR", "params": {}}}
    assert "total_num_steps" not in ds_config.fill_scheduler_length(ds, 77)["scheduler"]["params"]


AUTO = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": "auto"}}


@pytest.mark.parametrize("ds, cuda, bf16_ok, want, note", [
    (AUTO, False, False, {"bf16": False}, 'fp32 (bf16 "auto": no CUDA device)'),
    (AUTO, True, True, {"bf16": True}, 'bf16 (bf16 "auto": the CUDA device supports bf16)'),
    (AUTO, True, False, {"bf16": False}, 'fp32 (bf16 "auto": the CUDA device has no native bf16)'),
    ({**AUTO, "fp16": {"enabled": "auto"}}, True, False, {"bf16": False, "fp16": True},
     'fp16 (bf16/fp16 "auto": the CUDA device has no native bf16)'),
    ({**AUTO, "fp16": {"enabled": "auto"}}, True, True, {"bf16": True, "fp16": False},
     'bf16 (bf16/fp16 "auto": the CUDA device supports bf16)'),
    ({**AUTO, "fp16": {"enabled": "auto"}}, False, False, {"bf16": False, "fp16": False},
     'fp32 (bf16/fp16 "auto": no CUDA device)'),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": "auto"}}, True, True, {"bf16": True, "fp16": False},
     'bf16 (fp16 "auto": bf16 is set true)'),
    ({"bf16": {"enabled": "auto"}, "fp16": {"enabled": True}}, True, True, {"bf16": False, "fp16": True},
     'fp16 (bf16 "auto": fp16 is set true)'),
])
def test_auto_precision_follows_the_device(ds, cuda, bf16_ok, want, note):
    resolved, said = precision.resolve_precision(ds, "c.json", cuda=cuda, bf16_ok=bf16_ok)
    assert {name: resolved[name]["enabled"] for name in want} == want and said == note
    assert ds["bf16"]["enabled"] in ("auto", True), "the caller's dict is left as it was"


def test_fp16_auto_alone_on_a_bf16_gpu_says_why_fp16_not_that_bf16_runs():
    """FastChat's and transformers' NVMe files offer fp16 "auto" alone: the device's bf16 is not why fp16 was picked."""
    ds = {"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": "auto"}}
    resolved, said = precision.resolve_precision(ds, "c.json", cuda=True, bf16_ok=True)
    assert resolved["fp16"]["enabled"] is True
    assert said == 'fp16 (fp16 "auto": the file\'s only 16-bit section)'


def test_auto_precision_on_this_cpu_loads_as_fp32(tmp_path):
    ds = _load(tmp_path, json.loads((REPO / "ds_configs" / "zero2.json").read_text()))
    assert ds["torch_autocast"] == {"enabled": False, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    for name, note in (("zero2", 'fp32 (torch_autocast "auto": no CUDA device)'), ("bf16", "")):  # bf16: outright
        unresolved = ds_config.load_ds_config(REPO / "ds_configs" / f"{name}.json", resolve=False)
        assert precision.resolve_precision(unresolved, name, device=torch.device("cpu"))[1] == note


@pytest.mark.parametrize("capability, picked", [((7, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16 autocast"),
                                                ((9, 0), "bf16 autocast")])
def test_auto_precision_asks_the_compute_capability_not_emulated_bf16(capability, picked):
    """V100 (7.0) and T4 (7.5) emulate bf16, which torch.cuda.is_bf16_supported() counts; they take fp16."""
    ds = {**AUTOCAST, "fp16": {"enabled": "auto"}}
    resolved, said = precision.resolve_precision(ds, "c.json", cuda=True,
                                                 bf16_ok=precision.bf16_runs(capability))
    assert said.startswith(picked + " (")


def test_the_training_run_resolves_precision_once_the_device_is_set():
    """settings.parse leaves "auto" alone: asking the GPU then would open a context on GPU 0 in every rank."""
    from app import settings as config
    _, ds = config.parse(["--deepspeed_config", str(REPO / "ds_configs" / "zero2.json")])
    assert ds["torch_autocast"]["enabled"] == "auto"


AUTOCAST = {"train_micro_batch_size_per_gpu": 4, "torch_autocast": {"enabled": "auto", "dtype": "bfloat16"}}


@pytest.mark.parametrize("ds, cuda, bf16_ok, want, note", [
    (AUTOCAST, True, True, True, 'bf16 autocast (torch_autocast "auto": the CUDA device supports bf16)'),
    (AUTOCAST, True, False, False, 'fp32 (torch_autocast "auto": the CUDA device has no native bf16)'),
    (AUTOCAST, False, False, False, 'fp32 (torch_autocast "auto": no CUDA device)'),
    ({**AUTOCAST, "fp16": {"enabled": "auto"}}, True, False, False,
     'fp16 (torch_autocast/fp16 "auto": the CUDA device has no native bf16)'),
    ({"train_micro_batch_size_per_gpu": 4, "torch_autocast": {"enabled": "auto", "dtype": "float16"}}, True, False,
     True, 'fp16 autocast (torch_autocast "auto": the CUDA device has no native bf16)'),
])
def test_auto_autocast_follows_the_device(ds, cuda, bf16_ok, want, note):
    """The shipped configs' precision: DeepSpeed's torch_autocast section, on where the GPU runs its dtype."""
    resolved, said = precision.resolve_precision(ds, "c.json", cuda=cuda, bf16_ok=bf16_ok)
    assert resolved["torch_autocast"]["enabled"] is want and said == note
    assert ds["torch_autocast"]["enabled"] == "auto", "the caller's dict is left as it was"


def test_a_precision_that_is_not_a_bool_or_auto_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r'bf16.enabled must be true, false or "auto", got \'yes\''):
        _load(tmp_path, {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": "yes"}})


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("enabled", [True, "true"])
def test_bf16_and_fp16_both_true_is_one_line_on_every_device(tmp_path, cuda, enabled):
    """A CPU run used to drop fp16 and train in bf16; a GPU one met DeepSpeed's assertion. Neither says the fix."""
    ds = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "fp16": {"enabled": enabled}}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(ds))
    want = r'bf16.enabled and fp16.enabled are both true.*set one to false, or both to "auto"'
    for kwargs in ({"cuda": cuda, "bf16_ok": cuda}, {"resolve": False}):  # resolve=False: the training run's load
        with pytest.raises(UserError, match=want):
            ds_config.load_ds_config(path, **kwargs)
