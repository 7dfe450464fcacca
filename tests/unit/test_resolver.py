"""The one place a run's task is picked: from the flags, and for a run from the form of its rows."""
import json

import pytest

from app.core import preference, resolver, tasks
from app.errors import UserError
from app.settings import Settings
from conftest import REPO


@pytest.mark.parametrize("model, task, kind, name", [
    ("cnn", "auto", tasks.ImageClassification, "image_classification"),
    ("resnet18", "auto", tasks.ImageClassification, "image_classification"),
    ("gpt2-tiny", "auto", tasks.CausalLM, "causal_lm"),
    ("bert-tiny", "auto", tasks.SequenceClassification, "sequence_classification"),
    ("gpt2-tiny", "sequence_classification", tasks.SequenceClassification, "sequence_classification"),
    ("bert-tiny", "causal_lm", tasks.CausalLM, "causal_lm"),
    ("llama-tiny", "instruction", tasks.Instruction, "instruction"),
])
def test_build_picks_the_task(model, task, kind, name):
    built = resolver.build(Settings(model=model, task=task))
    assert type(built) is kind and built.name == name
    language_model = name in ("causal_lm", "instruction")
    assert built.loss is (tasks.next_token_loss if language_model else tasks.class_loss)
    assert built.correct is (tasks.next_token_correct if language_model else tasks.class_correct)


@pytest.mark.parametrize("task", ["causal_lm", "preference"])
def test_a_text_task_is_refused_for_image_models(task):
    with pytest.raises(UserError, match=rf"--task {task} trains a transformers model on text; cnn is an image model"):
        resolver.build(Settings(model="cnn", task=task))


def test_an_unknown_task_for_an_image_model_names_the_choices():
    with pytest.raises(UserError, match=r"--task 'translation' is not one of auto, causal_lm, instruction, preference, "
                                        r"grpo, sequence_classification for image models \(leave --task auto\)"):
        resolver.build(Settings(model="cnn", task="translation"))


def test_packing_is_refused_for_image_models():
    with pytest.raises(UserError, match="--packing on packs the rows of instruction data for a transformers model"):
        resolver.build(Settings(model="cnn", packing="on"))


def test_an_unknown_task_names_the_choices():
    with pytest.raises(UserError, match="--task 'translation' is not one of auto, causal_lm, instruction, "
                                        "preference, grpo, sequence_classification"):
        resolver.build(Settings(model="gpt2-tiny", task="translation"))


def _resolve(tmp_path, dataset, **given):
    settings = Settings(model="llama-tiny", tokenizer="bytes", dataset=str(dataset), **given)
    return resolver.resolve(settings, resolver.spec_of(settings), tmp_path / "run")


def test_a_run_picks_its_task_once_from_the_form_of_its_rows(tmp_path):
    """Blocks of text train a causal LM; chats, instruction tuning on their answers; pairs, preference tuning; each
    its own class from the start, holding its data (no task changes class once the data is read)."""
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400)))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {i}."},
                                                     {"role": "assistant", "content": f"{i}"}]}) + "\n"
                             for i in range(40)))
    pairs = REPO / "tests" / "data" / "preference" / "trl-zen-standard_explicit.jsonl"
    found = {name: _resolve(tmp_path / name, path, block_size=64)
             for name, path in (("text", text), ("chats", chats), ("pairs", pairs))}
    assert [type(task) for task in found.values()] == [tasks.CausalLM, tasks.Instruction, preference.Preference]
    for task in found.values():
        assert task.data.train is not None and len(task.data.held_out) > 0
        assert task.tokens_per_sample == task.sequences * task.data.info.seq_len
    assert found["chats"].answer_prompts(2)[0][0], "an instruction run shows its answers to held-out prompts"
    assert found["text"].answer_prompts(2) == [], "blocks of text have no prompts"
    assert found["pairs"].record()["reference"] == "frozen copy" and found["text"].record() == {}


def test_an_image_model_resolves_to_image_classification_with_its_data(tmp_path):
    task = resolver.resolve(Settings(model="mlp", dataset="digits"), None, tmp_path)
    assert type(task) is tasks.ImageClassification and len(task.data.train) > len(task.data.held_out) > 0
    assert task.data.info.num_classes == 10


def test_a_model_folder_without_weights_is_one_line_for_a_run_and_plans_for_the_tools(tmp_path):
    """A folder of the config alone (a download stopped before the weights) says so before any data is read; the
    plan needs the config alone and takes it; once a weight file is there, the run takes it too."""
    from app.core import models
    models.hf_spec("llama-tiny").config.save_pretrained(tmp_path)
    settings = Settings(model=str(tmp_path), tokenizer="bytes")
    with pytest.raises(UserError, match=rf"^model folder {tmp_path} has a config.json but no weights \(model."
                                        r"safetensors, pytorch_model.bin or their shards\): copy them in beside it"):
        resolver.spec_of(settings)
    assert type(resolver.build(settings)) is tasks.CausalLM
    (tmp_path / "training_args.bin").write_bytes(b"")  # a Trainer's arguments, not weights
    with pytest.raises(UserError, match="has a config.json but no weights"):
        resolver.spec_of(settings)
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")  # the shard's content is from_pretrained's to read
    assert resolver.spec_of(settings).pretrained == str(tmp_path)
