"""Export from hand-written checkpoint folders: each layout's weights, each output form, and the one-line refusals."""
import hashlib
import json
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from app.checkpoint.save import MANIFEST, STATE, TrainerState
from app.core import lora, models
from app.data import DataInfo
from app.data.tokenizers import byte_tokenizer
from app.errors import UserError
from app.parallel import pipeline, tensor_parallel
from app.settings import Settings
from app.tools import export
from conftest import REPO

DIGITS = DataInfo(10, 1, 8)
TEXT = DataInfo(0, task="causal_lm", vocab_size=258, seq_len=16)


def _checkpoint(folder, module: dict, model="cnn", info=DIGITS, lora_record=None, hf=None, files=None):
    """A ZeRO-0 checkpoint folder as a 1-rank run at step 3 saves it: the module's state dict, the transformers
    files when hf (a model whose config and a byte tokenizer go in hf/) is given, other files, the trainer state and
    the manifest."""
    folder.mkdir(parents=True)
    torch.save({"module": module, "global_steps": 3}, folder / "mp_rank_00_model_states.pt")
    if hf is not None:
        models.save_hf_files(hf.config, byte_tokenizer(), folder / models.HF_FILES)
        if lora_record:
            lora.save_config(hf, folder / models.HF_FILES)
    for name, value in (files or {}).items():
        torch.save(value, folder / name) if name.endswith(".pt") else (folder / name).write_text(json.dumps(value))
    state = TrainerState(step=3, epoch=0, batch=3, model=model, dataset="digits" if info is DIGITS else "chats.jsonl",
                         world_size=1, zero_stage=0, settings={"model": model, "seed": 42}, data_info=asdict(info),
                         deepspeed_config={"train_micro_batch_size_per_gpu": 8}, lora=lora_record or {})
    (folder / STATE).write_text(state.to_json())
    listed = {str(p.relative_to(folder)): {"size": p.stat().st_size,
                                           "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
              for p in sorted(folder.rglob("*")) if p.is_file()}
    (folder / MANIFEST).write_text(json.dumps(listed))
    return folder


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=320))


def test_a_zero_0_checkpoint_exports_its_weights_as_fp32_with_the_runs_record(tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file
    torch.manual_seed(0)
    trained = {name: t.to(torch.bfloat16) for name, t in models.build_model("cnn", DIGITS).state_dict().items()}
    folder = _checkpoint(tmp_path / "run" / "checkpoints" / "step00000003", trained)
    out = tmp_path / "exported" / "cnn.safetensors"
    assert export.main([str(folder), str(out)]) == 0
    count = sum(t.numel() for t in trained.values())
    assert capsys.readouterr().out == f"wrote 8 tensors ({count:,} fp32 parameters) to {out}\n"
    weights = load_file(out)
    assert weights.keys() == trained.keys()
    assert all(weights[k].dtype == torch.float32 and torch.equal(weights[k], t.float()) for k, t in trained.items())
    meta = {key: json.loads(value) for key, value in safe_open(str(out), "pt").metadata().items()}
    assert meta == {"model": "cnn", "dataset": "digits", "step": 3, "zero_stage": 0, "world_size": 1,
                    "data_info": json.loads(json.dumps(asdict(DIGITS)))}
    models.build_model(meta["model"], DataInfo(**meta["data_info"])).load_state_dict(weights, strict=True)


def test_a_pipeline_checkpoint_is_named_back_to_the_unsplit_model(tmp_path):
    """Each stage saved its layers under their local names; a tied weight is saved once, with its first layer."""
    embedding, head = torch.randn(6, 4).to(torch.bfloat16), torch.randn(3)
    folder = tmp_path / "step00000003"
    folder.mkdir()
    (folder / pipeline.LAYOUT).write_text(json.dumps([{"weight": ["embed.weight", "head.weight"]}, {},
                                                      {"bias": ["head.bias"]}]))
    torch.save({"weight": embedding}, folder / "layer_00-model_00-model_states.pt")
    torch.save({"bias": head}, folder / "layer_02-model_00-model_states.pt")
    state = export.fp32_state_dict(folder)
    assert state.keys() == {"embed.weight", "head.weight", "head.bias"}
    assert all(t.dtype == torch.float32 for t in state.values())
    assert torch.equal(state["head.weight"], embedding.float()) and torch.equal(state["head.bias"], head)


def test_a_tensor_parallel_checkpoint_exports_the_whole_weights_gathered_at_save_not_a_shard(tmp_path):
    whole = {"linear.weight": torch.randn(4, 2)}
    folder = tmp_path / "step00000003"
    folder.mkdir()
    torch.save(whole, folder / tensor_parallel.FULL_WEIGHTS)
    torch.save({"module": {"linear.weight": whole["linear.weight"][:2]}}, folder / "mp_rank_00_model_states.pt")
    assert torch.equal(export.fp32_state_dict(folder)["linear.weight"], whole["linear.weight"])


def test_a_transformers_checkpoint_exports_a_folder_that_from_pretrained_loads_with_its_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = _tiny_gpt2()
    module = {f"hf.{name}": t for name, t in hf.state_dict().items() if name != "lm_head.weight"}  # tied to wte
    folder = _checkpoint(tmp_path / "step00000003", module, model="gpt2-tiny", info=TEXT, hf=hf)
    state = export.export(folder, tmp_path / "out")
    assert state.keys() == module.keys()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in hf.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer("opposite?").input_ids == byte_tokenizer()("opposite?").input_ids


def test_the_exported_model_generates_as_its_base_did_without_the_padding_rows(tmp_path):
    """The checkpoint's config is the training one (no KV cache, a vocabulary padded to a multiple of 64) and keeps
    the base's generation settings: the export has the cache on, those settings, and the tokenizer's 300 tokens."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    hf = _tiny_gpt2()
    hf.config.unpadded_vocab_size, hf.config.use_cache = 300, False
    module = {f"hf.{name}": t for name, t in hf.state_dict().items() if name != "lm_head.weight"}
    folder = tmp_path / "step00000003"
    _checkpoint(folder, module, model="gpt2-tiny", info=TEXT, hf=hf)
    GenerationConfig(do_sample=True, temperature=0.6, eos_token_id=[1, 2]).save_pretrained(folder / models.HF_FILES)
    _checkpoint(tmp_path / "again", module, model="gpt2-tiny", info=TEXT, hf=hf)  # its manifest lists that file
    for name in ("manifest.json", "trainer_state.json"):
        (folder / name).write_bytes((tmp_path / "again" / name).read_bytes())
    export.export(folder, tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.config.vocab_size == 300 and not hasattr(loaded.config, "unpadded_vocab_size")
    assert torch.equal(loaded.transformer.wte.weight, hf.transformer.wte.weight[:300])
    assert loaded(torch.tensor([[5, 299]])).logits.shape[-1] == 300
    generation = GenerationConfig.from_pretrained(tmp_path / "out")
    assert loaded.config.use_cache and generation.use_cache
    assert (generation.temperature, generation.eos_token_id) == (0.6, [1, 2])


def test_an_export_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path):
    """A file size limit (as a full disk) stops the write half way: no file at out, none beside it, one line."""
    hf = _tiny_gpt2()
    folder = _checkpoint(tmp_path / "step00000003", {f"hf.{n}": t for n, t in hf.state_dict().items()},
                         model="gpt2-tiny", info=TEXT, hf=hf)
    out = tmp_path / "out" / "model.safetensors"
    limited = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 13, 1 << 13)); from app.tools import export; "
               f"sys.exit(export.main([{str(folder)!r}, {str(out)!r}]))")
    done = subprocess.run([sys.executable, "-c", limited], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith(f"error: export to {out} failed ("), done.stderr
    assert "nothing was written there" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert list((tmp_path / "out").iterdir()) == []
    (tmp_path / "file").write_text("")
    assert export.main([str(folder), str(tmp_path / "file" / "model.safetensors")]) == 2


def test_weights_that_do_not_fit_the_saved_config_are_one_line_and_write_nothing(tmp_path):
    hf = _tiny_gpt2()
    module = {f"hf.{name}": t for name, t in hf.state_dict().items() if name != "transformer.h.0.mlp.c_fc.weight"}
    module["hf.transformer.extra"] = torch.zeros(2)
    folder = _checkpoint(tmp_path / "step00000003", module, model="gpt2-tiny", info=TEXT, hf=hf)
    with pytest.raises(UserError) as caught:
        export.export(folder, tmp_path / "out")
    assert str(caught.value) == (f"{folder} does not match its saved config (missing "
                                 f"['transformer.h.0.mlp.c_fc.weight'], unexpected ['transformer.extra'])")
    assert not (tmp_path / "out").exists()


def test_a_lora_checkpoint_exports_the_adapter_folder_peft_loads_with_the_runs_tokenizer(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    base = _tiny_gpt2()
    wrapped = lora.wrap(_tiny_gpt2(), Settings(model="gpt2-tiny", lora=True), "causal_lm")
    with torch.no_grad():
        for p in wrapped.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    adapters = {f"hf.{name}": p.detach().clone() for name, p in wrapped.named_parameters() if p.requires_grad}
    record = {"rank": 8, "alpha": 16, "dropout": 0.0, "targets": lora.ALL_LINEAR,
              "base": "gpt2-tiny initialised with seed 42"}
    folder = _checkpoint(tmp_path / "step00000003", adapters, model="gpt2-tiny", info=TEXT, lora_record=record,
                         hf=wrapped)
    export.export(folder, tmp_path / "adapters")
    assert len(load_file(tmp_path / "adapters" / "adapter_model.safetensors")) == len(adapters)
    loaded = dict(PeftModel.from_pretrained(base, tmp_path / "adapters").named_parameters())
    assert all(torch.equal(loaded[name.removeprefix("hf.")], value) for name, value in adapters.items())
    assert AutoTokenizer.from_pretrained(tmp_path / "adapters").pad_token == byte_tokenizer().pad_token


@pytest.mark.parametrize("kind, out, flags, message", [
    ("cnn", "cnn", [], "holds a cnn image model; export it to a file ending in .safetensors"),
    ("text", "merged", ["--merged"], "holds a whole model; leave out --merged"),
    ("cnn", "cnn", ["--merged"], "holds a whole model; leave out --merged"),
    ("cnn", "cnn.safetensors", ["--merged"], "holds a whole model; leave out --merged"),
    ("lora", "m.safetensors", ["--merged"], "holds LoRA adapters: export them to a folder (the adapter folder "
                                            "peft loads), or with --merged to a folder of the whole model; not to "
                                            "m.safetensors"),
    ("lora", "m.safetensors", [], "holds LoRA adapters: export them to a folder"),  # not adapters as a whole model
    ("lora", "merged", ["--merged"], "--merged folds the adapters into the base model's weights, and gpt2-tiny was "
                                     "built from random weights the checkpoint does not hold"),
])
def test_an_export_it_cannot_make_is_one_error_line_and_writes_nothing(kind, out, flags, message, tmp_path,
                                                                        capsys):
    if kind == "cnn":
        folder = _checkpoint(tmp_path / "step00000003", models.build_model("cnn", DIGITS).state_dict())
    else:
        record = {"rank": 8, "base": "gpt2-tiny initialised with seed 42"} if kind == "lora" else None
        folder = _checkpoint(tmp_path / "step00000003", {"hf.w": torch.zeros(2)}, model="gpt2-tiny", info=TEXT,
                             lora_record=record)
    assert export.main([str(folder), str(tmp_path / out), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == [captured.err.strip()], captured.err
    assert captured.err.startswith("error: ") and message in captured.err, captured.err
    assert not (tmp_path / out).exists()
