"""The worked instruction example's files: chats answering each word's opposite, preference pairs choosing it, and the
tiny Llama folder."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file

from app.tools import instructions


def _rows(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _asked(question: str) -> tuple:
    """(the phrasing's index, the word) of a user turn."""
    for index, phrasing in enumerate(instructions.PHRASINGS):
        found = re.fullmatch(re.escape(phrasing).replace(r"\{\}", r"(\w+)"), question)
        if found:
            return index, found.group(1)
    raise AssertionError(f"{question!r} is in none of the phrasings")


def test_every_chat_asks_for_a_words_opposite_and_answers_it(tmp_path):
    path = instructions.write(tmp_path / "example", 400, seed=0)
    assert path == tmp_path / "example" / "chats.jsonl"
    rows = _rows(path)
    opposite = dict(instructions.OPPOSITES)
    asked = set()
    for row in rows:
        *system, user, assistant = row["messages"]
        assert system in ([], [{"role": "system", "content": instructions.SYSTEM}]), row
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        phrasing, word = _asked(user["content"])
        assert assistant["content"] == opposite[word], row
        asked.add((phrasing, word))
    assert len(rows) == 400
    assert {word for _, word in asked} == opposite.keys(), "every pair"
    assert {phrasing for phrasing, _ in asked} == set(range(len(instructions.PHRASINGS))), "every phrasing"
    with_system = sum(len(row["messages"]) == 3 for row in rows)
    assert 150 < with_system < 250, "a system turn in about half"


def test_the_same_seed_writes_the_same_chats_and_another_seed_others(tmp_path):
    first = instructions.write(tmp_path / "a", 50, seed=7).read_text()
    assert instructions.write(tmp_path / "b", 50, seed=7).read_text() == first
    assert instructions.write(tmp_path / "c", 50, seed=8).read_text() != first
    assert instructions.write(tmp_path / "a", 5, seed=7).read_text() == "".join(first.splitlines(True)[:5]), \
        "written again, not appended to"


def test_the_model_folder_is_a_small_llama_with_the_byte_tokenizer_and_no_chat_template(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = instructions.write_model(tmp_path, seed=0, layers=1)
    assert folder == tmp_path / "model"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and config.num_hidden_layers == 1
    assert {key: getattr(config, key) for key in instructions.SHAPE if key != "num_hidden_layers"} == \
        {key: value for key, value in instructions.SHAPE.items() if key != "num_hidden_layers"}
    assert len(tokenizer) <= config.vocab_size and config.vocab_size % 64 == 0
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == \
        (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert tokenizer.chat_template is None
    ids = tokenizer("Opposite of hot?", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], 320)


def test_the_same_seed_makes_the_same_weights(tmp_path):
    weights = [load_file(instructions.write_model(tmp_path / name, seed=seed, layers=1) / "model.safetensors")
               for name, seed in (("a", 3), ("b", 3), ("c", 4))]
    name = "model.layers.0.self_attn.q_proj.weight"
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
    assert not torch.equal(weights[0][name], weights[2][name])


def test_the_command_writes_both_and_says_where(tmp_path, capsys):
    instructions.main([str(tmp_path / "opposites"), "--rows", "12", "--seed", "1"])
    folder = tmp_path / "opposites"
    assert capsys.readouterr().out == f"wrote {folder / 'chats.jsonl'} and {folder / 'model'}\n"
    assert len(_rows(folder / "chats.jsonl")) == 12
    assert (folder / "model" / "config.json").is_file() and (folder / "model" / "tokenizer.json").is_file()
    assert json.loads((folder / "model" / "config.json").read_text())["num_hidden_layers"] == 2


def test_every_pair_chooses_the_opposite_and_rejects_another_word(tmp_path):
    path = instructions.write_pairs(tmp_path / "example", 400, seed=0)
    assert path == tmp_path / "example" / "pairs.jsonl"
    rows = _rows(path)
    opposite, words = dict(instructions.OPPOSITES), {w for both in instructions.OPPOSITES for w in both}
    rejected = set()
    for row in rows:
        assert set(row) == {"prompt", "chosen", "rejected"}
        *system, user = row["prompt"]
        assert system in ([], [{"role": "system", "content": instructions.SYSTEM}]) and user["role"] == "user"
        _, word = _asked(user["content"])
        assert row["chosen"] == [{"role": "assistant", "content": opposite[word]}], row
        [wrong] = row["rejected"]
        assert wrong["role"] == "assistant" and wrong["content"] in words and wrong["content"] != opposite[word]
        rejected.add(wrong["content"])
    assert len(rows) == 400 and len(rejected) > len(words) // 2, "the rejected word varies"
    assert instructions.write_pairs(tmp_path / "again", 400, seed=0).read_text() == path.read_text()
    assert instructions.write_pairs(tmp_path / "other", 400, seed=1).read_text() != path.read_text()


def test_the_pairs_are_conversational_preference_data_the_app_reads(tmp_path):
    from app.data import chat, preference
    from app.data.tokenizers import byte_tokenizer
    tokenizer = byte_tokenizer()
    chat.ensure_template(tokenizer)
    rows = _rows(instructions.write_pairs(tmp_path, 20, seed=3))
    assert preference.form_of(list(rows[0])) == "explicit"
    for i, row in enumerate(rows):
        encoded = preference.encode_row(tokenizer, row, f"row {i}", 1000)
        answer = tokenizer.decode(encoded["chosen"][encoded["prompt"]:])
        assert answer == row["chosen"][0]["content"] + "<|endoftext|>" and not encoded["same"]


def test_the_command_writes_pairs_instead_of_chats_when_asked(tmp_path, capsys):
    instructions.main([str(tmp_path), "--rows", "7", "--pairs"])
    assert capsys.readouterr().out == f"wrote {tmp_path / 'pairs.jsonl'} and {tmp_path / 'model'}\n"
    assert len(_rows(tmp_path / "pairs.jsonl")) == 7 and not (tmp_path / "chats.jsonl").exists()
    with pytest.raises(SystemExit):  # one kind of data a folder, not the first of two asked for
        instructions.main([str(tmp_path / "both"), "--pairs", "--prompts"])
    assert "not allowed with argument" in capsys.readouterr().err and not (tmp_path / "both").exists()


def test_prompts_for_grpo_carry_their_answer_and_the_reward_scores_it_as_trl_calls_it(tmp_path, capsys):
    from app.core import rewards
    instructions.main([str(tmp_path), "--rows", "9", "--prompts"])
    assert capsys.readouterr().out == f"wrote {tmp_path / 'prompts.jsonl'} and {tmp_path / 'model'}\n"
    rows = _rows(tmp_path / "prompts.jsonl")
    assert len(rows) == 9 and all(row["prompt"][-1]["role"] == "user" and row["answer"] for row in rows)
    exact = rewards.load(f"{tmp_path / 'rewards.py'}:exact_answer", "")
    said = [[{"role": "assistant", "content": f" {rows[0]['answer']} "}], [{"role": "assistant", "content": "no"}]]
    scored = rewards.score(exact, [rows[0]["prompt"]] * 2, said, [[1], [2]], {"answer": [rows[0]["answer"]] * 2}, 0,
                           ["row 0 (completion 0)", "row 0 (completion 1)"])
    assert scored.tolist() == [[1.0], [0.0]]
