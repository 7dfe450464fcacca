"""Keys older DeepSpeed took are read as today's DeepSpeed reads them, each change said in a note: published files
from transformers, axolotl and FlagEmbedding, and DeepSpeed's own getting-started example."""
import json

import pytest

from app.ds import config as ds_config
from app.ds import precision
from app.errors import UserError


def _load_saying(tmp_path, text: str, **kwargs) -> tuple:
    """(the loaded dict, the lines said while loading) of a config given as its file's text."""
    path, said = tmp_path / "c.json", []
    path.write_text(text)
    return ds_config.load_ds_config(path, say=said.append, **kwargs), said


# FlagOpen/FlagEmbedding, research/Matroyshka_reranker/finetune/compensation/stage1.json (commit f6924351), as
# published: fp16's loss scaling copied into "bf16", both sections "auto" as transformers' files have them
FLAG_EMBEDDING_STAGE1 = """{
    "zero_optimization": {
        "stage": 1,
        "reduce_bucket_size": 5e8
    },

    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "initial_scale_power": 10,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1
    },
    "bf16": {
        "enabled": "auto",
        "loss_scale": 0,
        "initial_scale_power": 10,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1
    },
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto",
            "torch_adam": true
        }
    },

    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto"
        }
    },

    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 1000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}
"""


def test_loss_scaling_in_a_bf16_section_is_dropped_with_a_note(tmp_path):
    """Older DeepSpeed ignored fp16's loss-scaling keys in "bf16"; 0.19 refuses them (extra inputs not permitted)."""
    ds, said = _load_saying(tmp_path, FLAG_EMBEDDING_STAGE1, resolve=False)
    assert ds["bf16"] == {"enabled": "auto"} and ds["fp16"]["initial_scale_power"] == 10, "fp16 keeps its own"
    assert said == ["note: " + str(tmp_path / "c.json") + ": dropped bf16.loss_scale, bf16.initial_scale_power, "
                    "bf16.loss_scale_window, bf16.hysteresis, bf16.min_loss_scale: fp16's loss scaling, which bf16 "
                    "(fp32's range) does not need and DeepSpeed no longer takes there"]
    for cuda, bf16_ok, picked in ((True, True, "bf16"), (True, False, "fp16"), (False, False, "fp32")):
        resolved, _ = precision.resolve_precision(ds, "c.json", cuda=cuda, bf16_ok=bf16_ok)  # "auto" in both: one
        assert [name for name in ("bf16", "fp16") if resolved[name]["enabled"]] == [picked] * (picked != "fp32")


# axolotl-ai-cloud/axolotl, deepspeed_configs/zero1_torch_compile.json (commit e7912a4a), as published: older
# DeepSpeed's "compile" section, which handed its keys to torch.compile
AXOLOTL_ZERO1_COMPILE = """{
  "zero_optimization": {
    "stage": 1,
    "overlap_comm": true
  },
  "bf16": {
    "enabled": "auto"
  },
  "fp16": {
    "enabled": "auto",
    "auto_cast": false,
    "loss_scale": 0,
    "initial_scale_power": 32,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "compile": {
    "disable": false,
    "backend": "inductor"
  },
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "wall_clock_breakdown": false
}
"""


@pytest.mark.parametrize("section, says", [
    (None, "compile.disable, compile.backend: older DeepSpeed's torch.compile settings; the app's --compile flag "
           "decides (auto: compiled on a CUDA device, by inductor)"),
    ({"disable": True}, "compile.disable: older DeepSpeed's torch.compile settings; the app's --compile flag decides "
                        "(auto: compiled on a CUDA device, by inductor): pass --compile off to train eager, as the "
                        "file asks"),
    ({"backend": "aot_eager", "kwargs": {"mode": "max-autotune"}, "deepcompile": False},
     "compile.backend, compile.kwargs: older DeepSpeed's torch.compile settings; the app's --compile flag decides "
     "(auto: compiled on a CUDA device, by inductor, not 'aot_eager')"),
])
def test_older_deepspeeds_compile_switch_is_dropped_with_a_note(tmp_path, section, says):
    """DeepSpeed 0.19's "compile" section refuses disable, backend and kwargs: the app's --compile does their work."""
    ds = json.loads(AXOLOTL_ZERO1_COMPILE)
    ds["compile"] = section or ds["compile"]
    ds, said = _load_saying(tmp_path, json.dumps(ds))
    assert said == [f"note: {tmp_path / 'c.json'}: dropped {says}"]
    assert ds.get("compile") == ({"deepcompile": False} if section and "deepcompile" in section else None)


# huggingface/transformers, docs/source/en/deepspeed.md ("NVMe configuration", commit 019da1e8): its ZeRO-3/Infinity
# example's zero_optimization section as published, "aio" inside it; the rest of that file is ds_config_zero2's
NVME_ZERO3 = """{
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": true,
            "buffer_count": 4,
            "fast_init": false
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": true,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9
        },
        "aio": {
            "block_size": 262144,
            "queue_depth": 32,
            "thread_count": 1,
            "single_submit": false,
            "overlap_events": true
        },
        "overlap_comm": true,
        "contiguous_gradients": true,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": true
    },
    "train_micro_batch_size_per_gpu": "auto"
}
"""


def test_an_apex_amp_section_off_or_auto_is_dropped_with_a_note_and_one_on_is_deepspeeds_to_refuse(tmp_path):
    """transformers' docs write "amp": {"enabled": "auto", "opt_level": "auto"} and fill it off; DeepSpeed 0.19
    refuses the section whatever it says."""
    where = tmp_path / "c.json"
    for enabled in ("auto", False):
        ds, said = _load_saying(tmp_path, json.dumps({"train_micro_batch_size_per_gpu": 2,
                                                      "amp": {"enabled": enabled, "opt_level": "auto"}}))
        assert "amp" not in ds and said == [f"note: {where}: dropped the amp section (NVIDIA Apex's amp, off or "
                                            f"\"auto\"), which DeepSpeed no longer has: the fp16, bf16 and "
                                            f"torch_autocast sections pick the precision"]
    with pytest.raises(UserError, match="NVIDIA Apex AMP integration has been removed"):
        _load_saying(tmp_path, json.dumps({"train_micro_batch_size_per_gpu": 2, "amp": {"enabled": True}}))


def test_aio_inside_zero_optimization_moves_to_the_top_level_with_a_note(tmp_path):
    """DeepSpeed reads "aio" at the top level only; inside zero_optimization 0.19 refuses it."""
    ds, said = _load_saying(tmp_path, NVME_ZERO3, resolve=False)
    assert "aio" not in ds["zero_optimization"]
    # thread_count, older DeepSpeed's name for intra_op_parallelism, takes today's name, its value kept
    assert ds["aio"] == {"block_size": 262144, "queue_depth": 32, "single_submit": False, "overlap_events": True,
                         "intra_op_parallelism": 1}
    where = tmp_path / "c.json"
    assert said == [f"note: {where}: moved zero_optimization.aio to the top level, where DeepSpeed reads it",
                    f"note: {where}: renamed aio.thread_count to aio.intra_op_parallelism, DeepSpeed's name for it "
                    f"today"]
    both = {"train_micro_batch_size_per_gpu": 1, "aio": {"thread_count": 2, "intra_op_parallelism": 4}}
    with pytest.raises(UserError, match="aio.thread_count and aio.intra_op_parallelism differ"):
        _load_saying(tmp_path, json.dumps(both))
    twice = {**json.loads(NVME_ZERO3), "aio": {"block_size": 1048576}}
    with pytest.raises(UserError, match="aio is set at the top level and, differently, inside zero_optimization"):
        _load_saying(tmp_path, json.dumps(twice))


# deepspeedai/DeepSpeed, docs/_tutorials/getting-started.md ("DeepSpeed Configuration"), as published: ZeRO's
# first form, a bare true
GETTING_STARTED = """{
  "train_batch_size": 8,
  "gradient_accumulation_steps": 1,
  "optimizer": {
    "type": "Adam",
    "params": {
      "lr": 0.00015
    }
  },
  "fp16": {
    "enabled": true
  },
  "zero_optimization": true
}"""


def test_zero_optimization_true_is_stage_1_as_deepspeed_reads_it(tmp_path):
    from app.ds.config import zero_stage
    ds, said = _load_saying(tmp_path, GETTING_STARTED, cuda=False, bf16_ok=False)
    assert ds["zero_optimization"] == {"stage": 1} and zero_stage(ds) == 1
    assert said[0] == f'note: {tmp_path / "c.json"}: read "zero_optimization": true as {{"stage": 1}}, as DeepSpeed does'
    ds, _ = _load_saying(tmp_path, GETTING_STARTED.replace('"zero_optimization": true', '"zero_optimization": false'),
                         cuda=False, bf16_ok=False)
    assert zero_stage(ds) == 0


# The shape of a stage-2 file published with accelerate's DeepSpeedPlugin examples: DeepSpeed's older offload switch
CPU_OFFLOAD_STAGE2 = """{
  "train_micro_batch_size_per_gpu": 4,
  "zero_optimization": {
    "stage": 2,
    "allgather_partitions": true,
    "allgather_bucket_size": 5e8,
    "overlap_comm": true,
    "reduce_scatter": true,
    "reduce_bucket_size": 5e8,
    "contiguous_gradients": true,
    "cpu_offload": true
  },
  "fp16": {"enabled": true},
  "amp": {"enabled": false}
}"""


def test_older_offload_switches_are_the_sections_deepspeed_reads_them_as(tmp_path):
    """The memory plan sees the optimizer on the host, as DeepSpeed puts it; both forms at once are one line."""
    from app.memory import estimate
    ds, said = _load_saying(tmp_path, CPU_OFFLOAD_STAGE2, cuda=True, bf16_ok=True)
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu"} and estimate.offloads(ds) == ("cpu", "")
    assert "cpu_offload" not in ds["zero_optimization"]
    assert f'note: {tmp_path / "c.json"}: read zero_optimization.cpu_offload: true as "offload_optimizer": ' \
           f'{{"device": "cpu"}}, as DeepSpeed does' in said
    stage3 = CPU_OFFLOAD_STAGE2.replace('"stage": 2', '"stage": 3').replace(
        '"cpu_offload": true', '"cpu_offload": false, "cpu_offload_param": true')
    ds, _ = _load_saying(tmp_path, stage3, cuda=True, bf16_ok=True)
    assert estimate.offloads(ds) == ("", "cpu") and "cpu_offload" not in ds["zero_optimization"]
    both = CPU_OFFLOAD_STAGE2.replace('"cpu_offload": true',
                                      '"cpu_offload": true, "offload_optimizer": {"device": "cpu"}')
    with pytest.raises(UserError, match="sets both cpu_offload, DeepSpeed's older switch, and offload_optimizer"):
        _load_saying(tmp_path, both, cuda=True, bf16_ok=True)
