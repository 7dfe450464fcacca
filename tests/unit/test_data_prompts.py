"""Prompts for --task grpo (app/data/prompts.py): text or messages rendered with the generation prompt, left-padded
to the longest, the other columns kept for the rewards; mistakes in one line."""
import json

import pytest

from app.data import TextModel, prompts
from app.errors import UserError
from app.settings import Settings
from conftest import started_tokenizer

MODEL = TextModel("", 320, 256)


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _sets(tmp_path, rows, **given):
    data = _write(tmp_path / "prompts.jsonl", rows)
    settings = Settings(model="llama-tiny", tokenizer="bytes", dataset=str(data), task="grpo",
                        max_completion_length=given.pop("max_completion_length", 8), **given)
    return prompts.prompt_sets(settings, MODEL, tmp_path / "run")


def test_prompts_are_rendered_left_padded_and_keep_their_columns(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"Add {i} and 1."}], "answer": str(i + 1)} for i in range(20)]
    train, held, info, tokenizer, kind = _sets(tmp_path, rows, eval_fraction=0.25)
    assert kind == "grpo" and (len(train), len(held)) == (15, 5)
    ids, (row, length) = train[0]
    text = tokenizer.decode(ids[-int(length):])
    assert text.startswith("<|user|>\nAdd ") and text.endswith(".<|endoftext|><|assistant|>\n"), \
        "the chat template's rendering, with the prompt of the answer to come"
    assert (ids[:len(ids) - int(length)] == tokenizer.pad_token_id).all(), "left-padded"
    assert ids.shape == (train.length,) and train.length == held.length, "one shape for every prompt"
    assert info.seq_len == train.length + 8
    columns = train.columns([int(row), int(train[1][1][0])])
    assert set(columns) == {"answer"} and len(columns["answer"]) == 2
    assert train.prompts([int(row)])[0][0]["role"] == "user"


def test_a_prompt_completion_sets_completion_columns_stay_from_the_rewards_as_in_trl(tmp_path):
    """TRL passes the reward functions every column but prompt, completion and completion_ids: a function that
    takes `completions` and no **kwargs trains on such a set."""
    rows = [{"prompt": f"2 + {i} =", "completion": f" {i + 2}", "completion_ids": [i], "answer": i} for i in range(10)]
    train = _sets(tmp_path, rows)[0]
    assert train.columns([0, 1]) == {"answer": [train.rows[0]["answer"], train.rows[1]["answer"]]}


def test_plain_text_prompts_are_tokenized_as_written(tmp_path):
    train, _, _, tokenizer, _ = _sets(tmp_path, [{"prompt": f"2 + {i} =", "answer": i + 2} for i in range(10)])
    ids, (_, length) = train[0]
    assert tokenizer.decode(ids[-int(length):]) in {f"2 + {i} =" for i in range(10)}


def test_a_text_prompt_opens_with_the_tokenizers_start_token_as_trls_grpo_tokenizes_it(tmp_path):
    """TRL's GRPOTrainer calls the tokenizer on a text prompt: Llama's <|begin_of_text|> comes first."""
    folder = tmp_path / "tok"
    started_tokenizer().save_pretrained(folder)
    data = _write(tmp_path / "prompts.jsonl", [{"prompt": f"2 + {i} ="} for i in range(10)])
    settings = Settings(model="llama-tiny", tokenizer=str(folder), dataset=str(data), task="grpo",
                        max_completion_length=8)
    train, _, _, tokenizer, _ = prompts.prompt_sets(settings, MODEL, tmp_path / "run")
    ids, (_, length) = train[0]
    assert tokenizer.decode(ids[-int(length):]).startswith("<s>2 + ")


@pytest.mark.parametrize("rows, given, message", [
    ([{"question": "q"}] * 10, {}, "--task grpo needs rows with a 'prompt' column"),
    ([{"prompt": "x" * 300}] * 10, {}, "the longest prompt \\(300 tokens\\) and --max_completion_length 8"),
    ([{"prompt": 5}] * 10, {}, "the prompt is neither text nor a list of messages"),
    ([{"prompt": "q", "trainer_state": 1}] * 10, {}, "--dataset has a column named 'trainer_state', the name of what "
                                                     "every reward function is given .*; rename the column"),
    ([{"prompt": "q", "prompts": "p"}] * 10, {}, "a column named 'prompts'"),
    ([{"prompt": "q", "prompt_ids": [1]}] * 10, {}, "a column named 'prompt_ids', where the app puts each prompt's"),
    ([{"prompt": "q"}] * 9 + [{"prompt": ""}], {}, "row \\d+: its prompt is empty; give every row a prompt"),
])
def test_rows_grpo_cannot_train_on_are_refused_in_one_line(tmp_path, rows, given, message):
    with pytest.raises(UserError, match=message):
        _sets(tmp_path, rows, **given)
