"""LoRA's parts without an engine: the flags checked, peft wrapping a tiny Llama (only adapters train, the same ones
from the seed), the adapters' sizes from the shape alone, the base model's fingerprint, the resume checks, and the
adapter folder and merged model written from a state dict. (Training, resume and export: tests/e2e/test_lora.py.)"""
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from app.checkpoint import resume
from app.checkpoint.save import TrainerState
from app.core import lora, resolver
from app.errors import UserError
from app.settings import Settings

FLAGS = Settings(lora=True)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=2, num_key_value_heads=2, vocab_size=64))


@pytest.mark.parametrize("flags, message", [(dict(lora_rank=0), "--lora_rank must be at least 1"),
                                            (dict(lora_alpha=0), "--lora_alpha must be above 0"),
                                            (dict(lora_dropout=1.0), "--lora_dropout at least 0 and below 1")])
def test_impossible_lora_flags_are_one_line(flags, message):
    with pytest.raises(UserError, match=message):
        Settings(lora=True, **flags)


def test_lora_on_an_image_model_is_one_line():
    with pytest.raises(UserError, match="--lora trains adapters on a transformers model.*cnn is an image model"):
        resolver.build(Settings(model="cnn", lora=True))


def test_a_target_the_model_does_not_have_is_named_with_those_it_has():
    with pytest.raises(UserError, match=r"has no module named qkv_proj; its linear layers are down_proj, gate_proj, "
                                        r"k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        lora.wrap(tiny_llama(), replace(FLAGS, lora_targets="q_proj,qkv_proj"), "causal_lm")


def test_loras_flags_without_lora_are_one_line_not_a_whole_model_trained():
    from dataclasses import fields
    assert lora.FLAGS == {f.name: f.default for f in fields(Settings) if f.name in lora.FLAGS}
    with pytest.raises(UserError, match="--lora_rank, --lora_targets set the adapters of a LoRA run, and --lora is "
                                        "not given, so the whole model would train: add --lora"):
        lora.check_flags(Settings(lora_rank=16, lora_targets="q_proj,v_proj"))
    lora.check_flags(Settings(lora=True, lora_rank=16))
    lora.check_flags(Settings())


def test_targets_match_as_peft_matches_them_and_are_recorded_as_it_takes_them():
    dotted = lora.wrap(tiny_llama(), replace(FLAGS, lora_targets="self_attn.q_proj"), "causal_lm")
    assert {name.split(".")[-4] for name, p in dotted.named_parameters() if p.requires_grad} == {"q_proj"}
    with pytest.raises(UserError, match="has no module named mlp.q_proj"):
        lora.wrap(tiny_llama(), replace(FLAGS, lora_targets="mlp.q_proj"), "causal_lm")
    spec = SimpleNamespace(pretrained="", config=None)
    spaced, plain = (lora.record(replace(FLAGS, model="llama", lora_targets=t), spec) for t in ("q_proj, v_proj",
                                                                                               "q_proj,v_proj"))
    assert spaced == plain and plain["targets"] == "q_proj,v_proj"


def test_only_the_adapters_train_and_their_sizes_are_known_from_the_shape():
    sizes = lora.adapter_sizes(tiny_llama(), lora.ALL_LINEAR, 8)
    wrapped = lora.wrap(tiny_llama(), FLAGS, "causal_lm")
    trained = {name: p.numel() for name, p in wrapped.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    assert sum(trained.values()) == sum(sizes) == 8 * (4 * (32 + 32) + 2 * (32 + 64) + (64 + 32))
    assert lora.counts(wrapped)[1] == sum(p.numel() for p in wrapped.parameters())
    named = lora.wrap(tiny_llama(), replace(FLAGS, lora_targets="q_proj, v_proj"), "causal_lm")
    assert {name.split(".")[-4] for name, p in named.named_parameters() if p.requires_grad} == {"q_proj", "v_proj"}
    for targets in ("self_attn.q_proj", "q_proj,lm_head,embed_tokens"):  # the plan counts what peft makes
        wrapped = lora.wrap(tiny_llama(), replace(FLAGS, lora_targets=targets), "causal_lm")
        made = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
        assert sum(lora.adapter_sizes(tiny_llama(), lora.targets_of(replace(FLAGS, lora_targets=targets)), 8)) == \
            made, targets


def test_the_adapters_start_from_the_seed_and_leave_the_random_stream_as_it_was():
    torch.manual_seed(5)
    first = lora.wrap(tiny_llama(), FLAGS, "causal_lm").state_dict()
    after_first = torch.rand(1)
    torch.manual_seed(5)
    torch.rand(3)  # another draw before: the adapters do not change
    second = lora.wrap(tiny_llama(), FLAGS, "causal_lm").state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    torch.manual_seed(5)
    lora.wrap(tiny_llama(), FLAGS, "causal_lm")
    assert torch.equal(torch.rand(1), after_first)


def test_lora_under_pipeline_stages_or_tensor_parallelism_is_one_line():
    with pytest.raises(UserError, match="LoRA runs under data parallel and ZeRO 0-3"):
        lora.check_layout(True, SimpleNamespace(split=object(), tensor=1))
    with pytest.raises(UserError, match="not pipeline stages or tensor parallelism"):
        lora.check_layout(True, SimpleNamespace(split=None, tensor=2))
    lora.check_layout(True, SimpleNamespace(split=None, tensor=1))


def test_the_fingerprint_follows_the_base_models_config_and_weights(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    before = lora.fingerprint(str(tmp_path), str(tmp_path), 1)
    assert lora.fingerprint(str(tmp_path), str(tmp_path), 2) == before, "weights that load: the seed plays no part"
    weights = tmp_path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(b ^ 0xFF for b in data[-4:])  # the last weight changes, the header does not
    weights.write_bytes(bytes(data))
    assert lora.fingerprint(str(tmp_path), str(tmp_path), 1) != before
    assert lora.fingerprint("llama-tiny", "", 1) != lora.fingerprint("llama-tiny", "", 2), "a preset: its seed"


def test_a_hub_models_fingerprint_is_the_revision_its_cached_snapshot_names(tmp_path):
    """The hub cache's layout as huggingface_hub writes it (refs/main naming a snapshot): a new commit pushed to
    the model gives another fingerprint; a checkpoint from when the revision could not be read keeps the name."""
    import subprocess
    import sys
    from app.checkpoint.save import same_base
    from conftest import REPO
    repo = tmp_path / "hub" / "models--org--tiny"
    for commit in ("a" * 40, "b" * 40):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
    said = []
    for commit in ("a" * 40, "b" * 40):
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        done = subprocess.run([sys.executable, "-c", "from app.core import lora; print(lora.fingerprint('org/tiny', "
                               "'org/tiny', 1))"], cwd=REPO, capture_output=True, text=True, timeout=120,
                              env={"PATH": "/usr/bin:/bin", "HF_HUB_CACHE": str(tmp_path / "hub"),
                                   "HF_HUB_OFFLINE": "1"})
        said.append(done.stdout.strip().splitlines()[-1])
    assert said == [f"org/tiny (hub, revision {'a' * 40})", f"org/tiny (hub, revision {'b' * 40})"]
    assert not same_base(said[0], said[1]) and same_base("org/tiny (hub, revision None)", said[1])
    assert not same_base("org/other (hub, revision None)", said[1])


def state(**lora_record) -> TrainerState:
    return TrainerState(step=4, epoch=0, batch=4, model="m", dataset="d", world_size=2, zero_stage=3, settings={},
                        data_info={}, deepspeed_config={}, lora=lora_record)


ADAPTED = dict(rank=8, alpha=16.0, dropout=0.0, targets="all-linear", base="abc")


@pytest.mark.parametrize("saved, current, message", [
    (ADAPTED, {**ADAPTED, "base": "def"}, "holds LoRA adapters trained on another base model than m has now"),
    (ADAPTED, {**ADAPTED, "rank": 16}, "was made with LoRA .*'rank': 8.* but this run has LoRA .*'rank': 16"),
    (ADAPTED, {}, "but this run has no LoRA; pass the same --lora flags"),
    ({}, ADAPTED, "was made with no LoRA but this run has LoRA")])
def test_adapters_resumed_onto_another_base_or_other_flags_are_one_line(tmp_path, saved, current, message):
    with pytest.raises(UserError, match=message):
        resume.check_compatible(state(**saved), state(**current), tmp_path)
    resume.check_compatible(state(**saved), state(**saved), tmp_path)
    spaced = {**ADAPTED, "targets": "q_proj, v_proj"}  # as a checkpoint of before recorded them, typed
    resume.check_compatible(state(**spaced), state(**{**ADAPTED, "targets": "q_proj,v_proj"}), tmp_path)


@pytest.mark.parametrize("targets", [lora.ALL_LINEAR, "q_proj,lm_head,embed_tokens"])
def test_the_adapter_folder_and_the_merged_model_hold_the_trained_adapters(targets, tmp_path):
    """A checkpoint's state dict (the app's names) written as peft's adapter folder loads back by value, and the
    merged model computes what the base with its adapters does; adapters on the output layer and the embeddings
    too (the base built on the meta device has no weights of them to save)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = tmp_path / "base"
    tiny_llama().save_pretrained(base)
    wrapped = lora.wrap(AutoModelForCausalLM.from_pretrained(base), replace(FLAGS, lora_targets=targets), "causal_lm")
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))  # as if trained: B is no longer zero
    files = tmp_path / "hf"
    wrapped.config.save_pretrained(files)
    lora.save_config(wrapped, files)
    state = {f"hf.{name}": p.detach() for name, p in wrapped.named_parameters() if p.requires_grad}
    lora.write_adapters(files, state, tmp_path / "adapters")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapters")
    again = dict(loaded.named_parameters())
    assert all(torch.equal(again[name.removeprefix("hf.")], value) for name, value in state.items())
    lora.merge(tmp_path / "adapters", str(base), "causal_lm", tmp_path / "merged", files)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.randint(64, (2, 8))
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, wrapped(input_ids=ids).logits, atol=1e-4)


def test_a_checkpoint_written_before_lora_existed_still_loads():
    """Trainer states saved without the lora field are whole runs: resume and export read them as such."""
    import json
    from dataclasses import asdict
    saved = asdict(state())
    del saved["lora"]
    assert TrainerState.from_json(json.dumps(saved), "old").lora == {}


@pytest.mark.parametrize("saved_ds, current_ds, message", [
    ({"bf16": {"enabled": True}}, {"torch_autocast": {"enabled": True}}, "trained with bf16 weights and this run has "
                                                                         "fp32 ones"),
    ({}, {"bf16": {"enabled": True}}, "trained with fp32 weights and this run has bf16 ones")])
def test_a_checkpoint_of_other_weights_precision_is_one_line(tmp_path, saved_ds, current_ds, message):
    """Precision "auto" weighs the GPU's memory, so a resumed run could land on the other kind of weights."""
    saved, current = replace(state(), deepspeed_config=saved_ds), replace(state(), deepspeed_config=current_ds)
    with pytest.raises(UserError, match=message):
        resume.check_compatible(saved, current, tmp_path)
    autocast_then_fp32 = replace(state(), deepspeed_config={"torch_autocast": {"enabled": True}})
    resume.check_compatible(autocast_then_fp32, replace(state(), deepspeed_config={}), tmp_path)



def test_every_block_of_a_lora_model_takes_an_input_that_needs_a_gradient():
    """ZeRO-3 reduces a leaf block's gradients in a full backward hook, which fires before the block's own backward
    when none of its inputs needs a gradient: with the embeddings frozen, the first block's would not."""
    wrapped = lora.wrap(tiny_llama(), FLAGS, "causal_lm")
    seen = []
    wrapped.base_model.model.model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    wrapped(torch.randint(64, (1, 8)))
    assert seen[0].requires_grad
