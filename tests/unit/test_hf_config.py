"""A model folder or hub name the app cannot train from is one line saying why, never a prompt or a traceback."""
import json

import pytest
from transformers import Gemma3Config, LlamaConfig

from app.core import hf_config, models
from app.errors import UserError


def _folder(tmp_path, config, **extra):
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **extra}))
    return str(tmp_path)


def test_a_model_that_brings_its_own_code_is_one_line_and_nothing_asks(tmp_path, monkeypatch):
    """transformers would ask on a terminal whether to run the folder's code, on every rank."""
    monkeypatch.setattr("builtins.input", lambda *_: pytest.fail("asked"))
    folder = _folder(tmp_path, LlamaConfig(), auto_map={"AutoConfig": "configuration_mine.MyConfig"})
    with pytest.raises(UserError, match="is a model with its own code \\(auto_map in its config.json\\), which the "
                                        "app does not run"):
        models.hf_spec(folder)


def test_a_model_newer_than_the_installed_transformers_says_upgrade(tmp_path):
    folder = _folder(tmp_path, LlamaConfig(), model_type="qwen9")
    with pytest.raises(UserError, match="is a 'qwen9' model, which transformers .* does not know: upgrade "
                                        "transformers"):
        models.hf_spec(folder)


def test_a_multimodal_model_is_one_line(tmp_path):
    """Gemma 3 4B and larger: the text settings sit in a part of the config; the vocabulary is not at its top."""
    folder = _folder(tmp_path, Gemma3Config(architectures=["Gemma3ForConditionalGeneration"]))
    with pytest.raises(UserError, match="is a multimodal model \\(Gemma3ForConditionalGeneration\\), and the app "
                                        "trains text models"):
        models.hf_spec(folder)


def test_a_hub_name_that_cannot_be_had_says_transformers_reason(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="unknown model 'nobody/no-model': .* nor a hub model that can be had now "
                                        "\\(.+\\)"):
        hf_config.read("nobody/no-model")


def test_a_folder_without_a_config_or_with_a_damaged_one_is_one_line(tmp_path):
    with pytest.raises(UserError, match="has no config.json"):
        models.hf_spec(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(UserError, match="config.json cannot be read .*: the folder may be damaged"):
        models.hf_spec(str(tmp_path))
