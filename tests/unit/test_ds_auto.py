"""DeepSpeed configs as the ecosystem writes them: "auto" filled in once, missing optimizers and batch sizes given
the app's defaults, DeepSpeed's spellings, older names and comment keys accepted, and every wrong value named by
its key. The configs below are written for these tests in the shapes people bring (tests/e2e/test_ds_auto.py
trains them)."""
import json

import pytest

from app.core import resolver
from app.ds import auto as ds_auto
from app.ds import config as ds_config
from app.ds import precision
from app.errors import UserError
from app.settings import Settings

# transformers' and accelerate's documented ZeRO-2 file: everything the Trainer owns is "auto"
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
# the ZeRO-3 one, with its stage-3 "auto"s and integers written as floats
HF_ZERO3 = {
    **{k: v for k, v in HF_ZERO2.items() if k not in ("zero_optimization", "scheduler")},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": "auto"},
}
# a model-only file (Megatron's, accelerate's "no optimizer" one): no optimizer, no batch keys
NO_OPTIMIZER = {"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0}
# a cluster's fp16 file tried on a laptop, with a note for people, an old spelling and a key DeepSpeed ignores
CLUSTER_FP16 = {"_comment": "8 x V100", "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                "fp16": {"enabled": True, "initial_scale_power": 12},
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 2, "cpu_offload": False, "reduce_bucket_size": 5e7},
                "cuda_visible_devices": "0,1,2,3,4,5,6,7", "steps_per_print": 1e4}


def _write(tmp_path, name, ds) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(ds))
    return str(path)


def test_an_accumulation_written_beside_an_auto_micro_batch_is_said_to_be_set_aside():
    """accelerate's templates write 1 beside "auto" micro and global batches: the search's accumulation makes up the
    app's global batch instead, and the filled-in block says so rather than listing it as an "auto" it filled."""
    for written in (1, 4):
        ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": written}
        filled, said = ds_auto.fill(ds, ds_auto.Facts(), replicas=2)
        assert "gradient_accumulation_steps" not in filled and filled["train_batch_size"] == 64
        assert said["gradient_accumulation_steps"] == (f"the file's {written} set aside: beside micro batch \"auto\" "
                                                       f"the accumulation makes up the global batch over the micro "
                                                       f"batch found")
    said = ds_auto.fill({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
                        ds_auto.Facts(), replicas=1)[1]
    assert said["gradient_accumulation_steps"] == ds_auto.FILLED["gradient_accumulation_steps"]


def test_every_auto_the_ecosystem_writes_loads_and_is_filled_in(tmp_path):
    for name, ds in (("zero2", HF_ZERO2), ("zero3", HF_ZERO3)):
        loaded = ds_config.load_ds_config(_write(tmp_path, name, ds), resolve=False)
        filled, said = ds_auto.fill(loaded, ds_auto.Facts(pretrained=True, hidden=64), replicas=2)
        assert filled["optimizer"]["params"] == {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
        assert filled["gradient_clipping"] == 1.0 and filled["zero_optimization"]["reduce_bucket_size"] == 64 * 64
        assert filled["scheduler"]["params"]["warmup_max_lr"] == 2e-5
        assert (filled["train_micro_batch_size_per_gpu"], filled["train_batch_size"]) == ("auto", 64)
        assert "gradient_accumulation_steps" not in filled, "the micro batch search makes up the rest"
        filled = ds_auto.fill_lengths(filled, 200, said)
        assert filled["scheduler"]["params"]["warmup_num_steps"] == 10 and not ds_auto.auto_paths(
            {k: v for k, v in filled.items() if k not in ("train_micro_batch_size_per_gpu", "fp16", "bf16")})
    zero3 = ds_auto.fill(ds_config.load_ds_config(_write(tmp_path, "z3", HF_ZERO3), resolve=False),
                         ds_auto.Facts(hidden=64, blocks=("Block",), block_size=50_000), 1)[0]["zero_optimization"]
    assert (zero3["stage3_prefetch_bucket_size"], zero3["stage3_param_persistence_threshold"],
            zero3["stage3_gather_16bit_weights_on_model_save"]) == (50_000, 640, True)


def test_zero3s_leaf_modules_and_prefetch_come_from_the_models_blocks():
    """The shipped zero3.json's "auto" leaf classes and prefetch bucket: the model's transformer block and its
    parameters; a model without blocks (the CNN) leaves both to DeepSpeed (its defaults: no leaf of its own)."""
    shipped = ds_config.load_ds_config(ds_config.REPO / "ds_configs" / "zero3.json", resolve=False)
    facts = resolver.auto_facts(resolver.build(Settings(model="llama-1b")).spec)
    zero, said = ds_auto.fill(shipped, facts, 8)
    zero = zero["zero_optimization"]
    assert (zero["leaf_module"], zero["stage3_prefetch_bucket_size"]) == ({"classes": ["LlamaDecoderLayer"]}, 60_821_504)
    assert "zero_optimization.leaf_module.classes" in said
    plain = ds_auto.fill(shipped, resolver.auto_facts(resolver.build(Settings(model="cnn")).spec), 1)[0]["zero_optimization"]
    assert plain["leaf_module"] == {} and "stage3_prefetch_bucket_size" not in plain


@pytest.mark.parametrize("model", ["llama-1b", "cnn"])
def test_zero3s_persistence_is_none_on_cpu_ranks_with_leaf_blocks_else_ten_hidden(model, tmp_path):
    """Over gloo DeepSpeed gathers each persistent weight in a collective of its own after every step, so CPU ranks
    whose transformer blocks are leaf modules persist nothing (a block's one gather brings its small weights); on a
    GPU (and in app.tools.plan, which plans one), and without leaf blocks (the CNN, HF's ZeRO-3 file), the
    threshold is 10 x hidden, HF's rule, else DeepSpeed's (a model without a hidden size)."""
    shipped = ds_config.load_ds_config(ds_config.REPO / "ds_configs" / "zero3.json", resolve=False)
    hf = ds_config.load_ds_config(_write(tmp_path, "z3", HF_ZERO3), resolve=False)
    spec = resolver.build(Settings(model=model)).spec
    key = "stage3_param_persistence_threshold"
    threshold = {(name, device): ds_auto.fill(ds, resolver.auto_facts(spec, device), 2)[0]["zero_optimization"].get(key)
                 for name, ds in (("shipped", shipped), ("hf", hf)) for device in ("cpu", "cuda", None)}
    gpu = 20_480 if model == "llama-1b" else None
    assert threshold == {("shipped", "cpu"): 0 if model == "llama-1b" else None, ("shipped", "cuda"): gpu,
                         ("shipped", None): gpu, ("hf", "cpu"): gpu, ("hf", "cuda"): gpu, ("hf", None): gpu}


def test_a_model_without_a_hidden_size_leaves_bucket_sizes_to_deepspeed():
    filled = ds_auto.fill({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
                           "train_micro_batch_size_per_gpu": 4}, ds_auto.Facts(), 1)[0]
    assert "reduce_bucket_size" not in filled["zero_optimization"]


def test_no_optimizer_gets_the_apps_and_offload_gets_deepspeeds_cpu_adam():
    plain = ds_auto.fill(NO_OPTIMIZER, ds_auto.Facts(), 1)[0]
    assert plain["optimizer"]["params"]["fused"] is True and plain["optimizer"]["params"]["lr"] == 2e-3
    assert plain["scheduler"]["type"] == "WarmupCosineLR"
    offload = ds_auto.fill({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
                           ds_auto.Facts(pretrained=True), 1)[0]
    assert "fused" not in offload["optimizer"]["params"] and offload["optimizer"]["params"]["lr"] == 2e-5


@pytest.mark.parametrize("ds, message", [
    ({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": "fast"}}},
     "optimizer.params.lr must be a number, got 'fast'"),
    ({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}},
     "optimizer.params.lr must be a number, got '1e-3' (a string: drop the quotes)"),
    ({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2, "overlap_com": True}},
     "did you mean 'overlap_comm'"),
    ({"train_micro_batch_size_per_gpu": 4, "steps_per_prnt": 10}, "did you mean 'steps_per_print'"),
    ({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                                                 "round_robin_gradients": "auto"}},
     "zero_optimization.round_robin_gradients is \"auto\", which the app does not fill in"),
])
def test_wrong_values_and_likely_typos_are_one_line_naming_the_key(ds, message, tmp_path):
    with pytest.raises(UserError) as caught:
        ds_config.load_ds_config(_write(tmp_path, "mine", ds), resolve=False)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_comments_old_spellings_floats_and_ignored_keys_load(tmp_path, capsys):
    ds = ds_config.load_ds_config(_write(tmp_path, "cluster", CLUSTER_FP16), resolve=False)
    assert "_comment" not in ds and "cuda_visible_devices" not in ds and ds["steps_per_print"] == 10000
    assert "DeepSpeed does not read 'cuda_visible_devices'; ignored" in capsys.readouterr().out
    resolved, note = precision.resolve_precision(ds, "cluster.json", cuda=False)
    assert resolved["fp16"]["enabled"] is False and note.startswith("fp32 (cluster.json sets fp16.enabled true")


def test_older_names_and_words_for_switches_load_as_deepspeed_reads_them(tmp_path):
    """transformers' bf16 file names the section "bfloat16"; Open-Assistant's writes "enabled": "true"; InternVL's
    asks fp16 to cast the inputs ("auto_cast"), which DeepSpeed does even with fp16 off."""
    ds = ds_config.load_ds_config(_write(tmp_path, "old", {"train_micro_batch_size_per_gpu": 4,
                                                           "bfloat16": {"enabled": "auto"}}), resolve=False)
    assert ds["bf16"] == {"enabled": "auto"} and "bfloat16" not in ds
    words = {"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": "true", "auto_cast": True}}
    resolved, note = precision.resolve_precision(words, "w.json", cuda=False)
    assert resolved["fp16"] == {"enabled": False, "auto_cast": False} and "needs a CUDA device" in note
    cast = {"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": "auto", "auto_cast": True},
            "bf16": {"enabled": "auto"}}
    resolved, _ = precision.resolve_precision(cast, "c.json", cuda=True, bf16_ok=True)
    assert resolved["bf16"]["enabled"] is True and resolved["fp16"] == {"enabled": False, "auto_cast": False}
