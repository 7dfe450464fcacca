"""Preference pairs: every form of the public files in tests/data/preference found, split and labelled on the
answers alone, the prompt's tokens shared by both sequences; cuts to the block; the rows as padded pairs."""
import json
import math
import pickle

import datasets
import pytest
import torch

from app.data import chat, forms, preference
from app.data.tokenizers import byte_tokenizer
from app.errors import UserError
from app.settings import Settings
from conftest import REPO, started_tokenizer

DATA = REPO / "tests" / "data" / "preference"
EOS = "<|endoftext|>"
BIG = 100_000
FORMS = {"anthropic-hh-rlhf-harmless-standard_implicit.jsonl": "implicit",
         "h4-ultrafeedback_binarized-conversational_prompt_text.jsonl": "explicit",
         "llamafactory-dpo_en_demo-sharegpt.jsonl": "explicit",
         "trl-zen-conversational_explicit.jsonl": "explicit", "trl-zen-conversational_implicit.jsonl": "implicit",
         "trl-zen-standard_explicit.jsonl": "explicit", "trl-zen-standard_implicit.jsonl": "implicit"}
SPEAKERS = {"human": "user", "gpt": "assistant", "system": "system"}


def tokenizer():
    made = byte_tokenizer()
    chat.ensure_template(made)
    return made


def load(name: str):
    return datasets.load_dataset("json", data_files=str(DATA / name), split="train")


def trl_split(chosen: str, rejected: str) -> tuple:
    """TRL's _extract_prompt (trl/data_utils.py), written out: the shared start, a space before the first
    difference left with the answers."""
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def rendered(turns: list) -> str:
    """The default template written out: a role header, the text and the end-of-text token per turn."""
    return "".join(f"<|{t['role']}|>\n{t['content']}{EOS}" for t in turns)


def expected(row: dict) -> tuple:
    """(prompt text, chosen answer text, rejected answer text) as the model should see them."""
    if "conversations" in row:
        prompt = [{"role": SPEAKERS[m["from"]], "content": m["value"]} for m in row["conversations"]]
        chosen, rejected = ([{"role": "assistant", "content": row[w]["value"]}] for w in ("chosen", "rejected"))
    elif isinstance(row["chosen"], str):
        prompt, chosen, rejected = (row["prompt"], row["chosen"], row["rejected"]) if "prompt" in row else \
            trl_split(row["chosen"], row["rejected"])
        return prompt, chosen + EOS, rejected + EOS
    elif "prompt" in row and not isinstance(row["prompt"], str):
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    else:  # the conversations' shared start (UltraFeedback's text prompt beside them left aside, as TRL does)
        shared = next(n for n in range(len(row["chosen"]) + 1) if row["chosen"][n] != row["rejected"][n])
        prompt, chosen, rejected = row["chosen"][:shared], row["chosen"][shared:], row["rejected"][shared:]
    start = rendered(prompt) + "<|assistant|>\n"
    assert start.endswith("<|assistant|>\n")
    return start, rendered(prompt + chosen)[len(start):], rendered(prompt + rejected)[len(start):]


@pytest.mark.parametrize("name", sorted(FORMS))
def test_every_public_row_is_split_rendered_and_labelled_on_its_answers(name):
    tok, rows = tokenizer(), load(name)
    assert sorted(p.name for p in DATA.glob("*.jsonl")) == sorted(FORMS)
    assert preference.form_of(rows.column_names) == FORMS[name]
    for i, row in enumerate(rows):
        encoded = preference.encode_row(tok, row, f"row {i}", BIG)
        prompt, *answers = expected(row)
        p = encoded["prompt"]
        assert p == len(tok(prompt, add_special_tokens=False)["input_ids"]) > 0, (name, i)
        assert encoded["chosen"][:p] == encoded["rejected"][:p] == tok(prompt, add_special_tokens=False)["input_ids"]
        assert not encoded["cut"] and not encoded["same"]
        for which, answer in zip(("chosen", "rejected"), answers):
            ids, labels = encoded[which], encoded[f"{which}_labels"]
            assert labels[:p] == [chat.IGNORE] * p and labels[p:] == ids[p:], (name, i, which)
            assert tok.decode(ids[:p]) == prompt and tok.decode(ids[p:]) == answer, (name, i, which)
            assert answer.endswith(EOS) and encoded[f"{which}_units"] == len(ids) - p


def test_a_text_pair_opens_with_the_tokenizers_start_token_as_trls_dpo_tokenizes_it():
    tok = started_tokenizer()
    encoded = preference.encode_row(tok, {"prompt": "Sky?", "chosen": " blue", "rejected": " green"}, "r", BIG)
    assert tok.decode(encoded["chosen"]) == "<s>Sky? blue</s>" and tok.decode(encoded["rejected"]) == \
        "<s>Sky? green</s>"
    assert encoded["prompt"] == 5 and encoded["chosen_labels"][:5] == [chat.IGNORE] * 5


def test_a_chosen_text_that_starts_the_rejected_keeps_its_last_character():
    row = load("anthropic-hh-rlhf-harmless-standard_implicit.jsonl")[20]
    assert row["rejected"].startswith(row["chosen"]) and row["chosen"].endswith(" ")
    tok = tokenizer()
    encoded = preference.encode_row(tok, row, "row 20", BIG)
    prompt, chosen, rejected = trl_split(row["chosen"], row["rejected"])
    assert chosen == " " and tok.decode(encoded["chosen"][encoded["prompt"]:]) == chosen + EOS
    assert tok.decode(encoded["rejected"]) == prompt + rejected + EOS


def test_the_implicit_text_split_keeps_the_space_with_the_answers_even_inside_a_word():
    assert preference._shared_start("Flat is better than nested.", "Flat is better than chocolate.") == 19
    assert preference._shared_start("enough to break", "enough to become") == 11, "inside a word: no space"
    assert preference.split_row({"chosen": "a b", "rejected": "a c"}, "r") == ("a", " b", " c")
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert preference._shared_start(turns, [turns[0], {"role": "assistant", "content": "b"}]) == 1


def test_the_form_needs_both_answers_and_a_prompt_or_conversations_makes_it_explicit():
    assert preference.form_of(["chosen", "rejected"]) == "implicit"
    assert preference.form_of(["prompt", "chosen", "rejected"]) == "explicit"
    assert preference.form_of(["conversations", "chosen", "rejected"]) == "explicit"
    assert preference.form_of(["prompt", "chosen"]) == "" and preference.form_of(["messages"]) == ""
    assert preference.form_of(["instruction", "input", "chosen", "rejected"]) == "explicit"
    assert preference.form_of(["messages", "chosen", "rejected"]) == "explicit"


def test_llamafactorys_ranking_rows_keep_their_prompt_and_system():
    """LLaMA-Factory's documented preference rows (data/README.md): Alpaca's instruction and input beside text
    answers, ShareGPT's conversations with a system column, a chat's messages; numbers in cells read as text."""
    alpaca = {"instruction": "Translate: cat", "input": "into French", "system": "Be brief.", "chosen": "chat",
              "rejected": "chien"}
    prompt, chosen, rejected = preference.split_row(alpaca, "row 0")
    assert prompt == [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Translate: cat\n\ninto French"}]
    assert (chosen, rejected) == ([{"role": "assistant", "content": "chat"}],
                                  [{"role": "assistant", "content": "chien"}])
    tok = tokenizer()
    encoded = preference.encode_row(tok, alpaca, "row 0", BIG)
    asked = tok.decode(encoded["chosen"][:encoded["prompt"]])
    assert "Translate: cat" in asked and "Be brief." in asked
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}], "system": "You are a pirate.",
                "chosen": {"from": "gpt", "value": "arr"}, "rejected": {"from": "gpt", "value": "hello"}}
    assert preference.split_row(sharegpt, "row 1")[0] == [{"role": "system", "content": "You are a pirate."},
                                                           {"role": "user", "content": "hi"}]
    chat_row = {"messages": [{"role": "user", "content": "hi"}], "chosen": {"role": "assistant", "content": "yes"},
                "rejected": {"role": "assistant", "content": "no"}}
    assert preference.split_row(chat_row, "row 2")[0] == [{"role": "user", "content": "hi"}]
    assert preference.split_row({"prompt": "What is 2+2?", "chosen": 4, "rejected": 5.0}, "row 3") == \
        ("What is 2+2?", "4", "5")
    with pytest.raises(UserError, match="row 4: its rejected answer is empty"):
        preference.split_row({**alpaca, "rejected": ""}, "row 4")


def test_a_text_prompt_beside_conversations_that_hold_it_is_their_shared_start_as_trl_reads_it():
    """UltraFeedback's form: the prompt column's text is left aside for the user's turn the answers share; a text
    prompt beside answers of assistant turns alone holds the only prompt, so it stays a mistake of forms."""
    row = load("h4-ultrafeedback_binarized-conversational_prompt_text.jsonl")[0]
    prompt, chosen, rejected = preference.split_row(row, "row 0")
    assert prompt == [{"content": row["prompt"], "role": "user"}] == row["chosen"][:1]
    assert chosen == row["chosen"][1:] and rejected == row["rejected"][1:]
    answers = [[{"role": "assistant", "content": a}] for a in ("a", "b")]
    with pytest.raises(UserError, match="not all text nor all lists of turns"):
        preference.split_row({"prompt": "q", "chosen": answers[0], "rejected": answers[1]}, "row 1")


def test_bad_rows_are_one_line_each_naming_the_row():
    tok = tokenizer()
    bad = [({"prompt": "q", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}, "not all text"),
           ({"prompt": "q", "chosen": "", "rejected": "b"}, "its chosen answer is empty"),
           ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "user", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "b"}]}, "its chosen answer has no assistant turn")]
    for row, message in bad:
        with pytest.raises(UserError, match=message) as caught:
            preference.encode_row(tok, row, "row 7", BIG)
        assert str(caught.value).startswith("row 7") and "\n" not in str(caught.value)
    encode = preference.encoder(tok, BIG, "train")
    with pytest.raises(UserError, match="row 5 of the train preference data"):
        encode({"prompt": ["q", "q"], "chosen": ["a", ""], "rejected": ["b", "c"]}, [4, 5])


def test_a_block_shorter_than_the_row_cuts_it_and_counts_the_kept_answer_tokens():
    tok = tokenizer()
    row = {"prompt": "Beautiful is better than", "chosen": " ugly.", "rejected": " the moon."}
    p = len(row["prompt"].encode())
    encoded = preference.encode_row(tok, row, "r", p + 3)
    assert encoded["cut"] and encoded["prompt"] == p
    assert (encoded["chosen_units"], encoded["rejected_units"]) == (3, 3)
    assert tok.decode(encoded["chosen"]) == "Beautiful is better than ug"
    assert encoded["chosen_labels"] == [chat.IGNORE] * p + encoded["chosen"][p:]
    whole = preference.encode_row(tok, row, "r", p + len(" the moon.") + 1)
    assert not whole["cut"] and whole["chosen_units"] == len(" ugly.") + 1
    lost = preference.encode_row(tok, row, "r", p - 2)
    assert lost["cut"] and lost["prompt"] == p - 2 and lost["chosen_units"] == lost["rejected_units"] == 0


def test_pair_rows_are_padded_pairs_with_the_reference_zero_until_set():
    tok = tokenizer()
    rows = load("trl-zen-standard_explicit.jsonl")
    encoded = rows.map(preference.encoder(tok, BIG, "train"), batched=True, with_indices=True,
                       remove_columns=rows.column_names)
    length = max(len(ids) for w in ("chosen", "rejected") for ids in encoded[w])
    pairs = preference.PairRows(encoded, tok.pad_token_id, length)
    assert len(pairs) == len(rows) == 19
    for i in (0, 8):
        ids, (labels, reference) = pairs[i]
        assert ids.shape == labels.shape == (2, length) and reference.tolist() == [0.0, 0.0]
        for k, which in enumerate(("chosen", "rejected")):
            n = len(encoded[i][which])
            assert ids[k, :n].tolist() == encoded[i][which] and (ids[k, n:] == tok.pad_token_id).all()
            assert labels[k, :n].tolist() == encoded[i][f"{which}_labels"] and (labels[k, n:] == chat.IGNORE).all()
        prompt, answer = pairs.prompt(i)
        assert tok.decode(prompt) == rows[i]["prompt"] and tok.decode(answer) == rows[i]["chosen"] + EOS
    pairs.add_reference(torch.arange(2 * len(pairs), dtype=torch.float32).view(-1, 2) - 50)
    assert pairs[3][1][1].tolist() == [-44.0, -43.0]
    real = sum(len(ids) for w in ("chosen", "rejected") for ids in encoded[w])
    assert math.isclose(pairs.per_sample()["real_tokens"], real / 19) and pairs.per_sample()["rows"] == 1.0


PAIRS = REPO / "tests" / "data" / "preference" / "trl-zen-standard_explicit.jsonl"


def _chat_tokenizer():
    made = byte_tokenizer()
    chat.ensure_template(made)
    return made


def _pair_rows(extra=()) -> list:
    return [json.loads(line) for line in PAIRS.read_text().splitlines()] + list(extra)


def test_the_reference_is_a_column_of_the_pairs_that_travels_with_them():
    """add_reference keeps the log-probabilities as the rows' column, in place of any before, under the pairs'
    fingerprint (the reference file's key); a loader's worker gets them with the rows (pickled)."""
    tok = tokenizer()
    rows = load("trl-zen-standard_explicit.jsonl")
    encoded = rows.map(preference.encoder(tok, BIG, "train"), batched=True, with_indices=True,
                       remove_columns=rows.column_names)
    pairs = preference.PairRows(encoded, tok.pad_token_id, 400)
    fingerprint = pairs.dataset._fingerprint
    assert fingerprint == encoded.with_format("torch")._fingerprint, "the zeros before precompute change no key"
    assert torch.equal(pairs.reference, torch.zeros(len(pairs), 2))
    pairs.add_reference([[-1.5, -2.5]] * len(pairs))
    table = torch.arange(2.0 * len(pairs)).view(-1, 2).tolist()
    pairs.add_reference(table)
    assert pairs.dataset.column_names.count("reference") == 1 and pairs.dataset._fingerprint == fingerprint
    assert pairs.reference.dtype == torch.float32 and pairs.reference.tolist() == table
    sent = pickle.loads(pickle.dumps(pairs))
    assert sent[4][1][1].tolist() == table[4] and torch.equal(sent[4][0], pairs[4][0])


def test_pair_rows_leave_out_pairs_with_the_same_answers_and_say_so(capsys):
    same = {"prompt": "Same?", "chosen": " yes", "rejected": " yes"}
    rows = preference.pair_rows(datasets.Dataset.from_list(_pair_rows([same])), _chat_tokenizer(), 1000, "train")
    said = capsys.readouterr().out
    assert ("train: 1 of 20 pairs have the same answer chosen and rejected (within the block); they teach nothing "
            "and are left out") in said and "cut" not in said
    assert len(rows) == len(rows.data) == 19 and not any(rows["same"]) and not any(rows["cut"])


def test_pair_rows_cut_to_the_block_leave_out_pairs_that_lost_an_answer_and_say_so(capsys):
    tok, pairs, block = _chat_tokenizer(), _pair_rows(), 30

    def ids(row, which):
        return tok(row["prompt"] + row[which], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    cut = sum(max(len(ids(row, "chosen")), len(ids(row, "rejected"))) > block for row in pairs)
    lost = sum(len(row["prompt"].encode()) >= block for row in pairs)
    kept = [row for row in pairs if ids(row, "chosen")[:block] != ids(row, "rejected")[:block]]
    rows = preference.pair_rows(datasets.Dataset.from_list(pairs), tok, block, "train")
    assert f"train: {cut} of 19 pairs are longer than the block of 30 tokens and were cut; {lost} lost every token " \
           f"of an answer and are left out (--block_size sets the block)" in capsys.readouterr().out
    assert 0 < lost < cut < 19 and 0 < len(kept) < 19 - lost, "some kept pairs are the same once cut"
    assert len(rows) == len(rows.data) == len(kept)
    assert [tok.decode(r["chosen"][:r["prompt"]]) for r in rows] == [row["prompt"] for row in kept]
    assert all(len(r["chosen"]) <= block and r["chosen_units"] > 0 and r["rejected_units"] > 0 for r in rows)
    with pytest.raises(UserError, match="no train preference pair keeps two different answers within the block of "
                                        "5 tokens; raise --block_size"):
        preference.pair_rows(datasets.Dataset.from_list(pairs), tok, 5, "train")


def test_pair_sets_pad_both_splits_to_the_longest_answer_and_refuse_packing():
    tok, pairs = _chat_tokenizer(), _pair_rows()
    train, held = (preference.pair_rows(datasets.Dataset.from_list(rows), tok, 1000, what)
                   for rows, what in ((pairs[:15], "train"), (pairs[15:], "held-out")))
    with pytest.raises(UserError, match="--packing on packs instruction rows; preference pairs are not packed"):
        preference.pair_sets(train, held, tok, 1000, Settings(model="llama-tiny", packing="on"))
    train_pairs, held_pairs, info = preference.pair_sets(train, held, tok, 1000, Settings(model="llama-tiny"))
    longest = max(len((row["prompt"] + row[w]).encode()) + 1 for row in pairs for w in ("chosen", "rejected"))
    assert (len(train_pairs), len(held_pairs)) == (15, 4)
    assert train_pairs.length == held_pairs.length == info.seq_len == longest
    assert (info.task, info.vocab_size, info.packed) == ("causal_lm", len(tok), False)
    assert train_pairs[0][0].shape == held_pairs[3][0].shape == (2, longest)


def test_the_form_of_preference_pairs_and_the_tasks_that_refuse_them():
    pairs = datasets.Dataset.from_list(_pair_rows())
    implicit = pairs.remove_columns("prompt")
    plain = datasets.Dataset.from_list([{"text": "a"}, {"text": "b"}])
    settings = Settings(model="llama-tiny", dataset="pairs.jsonl")
    assert forms.instruction_form(pairs, "preference", settings) == "explicit"
    assert forms.instruction_form(implicit, "causal_lm", settings) == "implicit"
    assert forms.instruction_form(implicit, "causal_lm", Settings(model="llama-tiny", text_column="chosen")) == ""
    with pytest.raises(UserError, match="--task preference needs rows with 'chosen' and 'rejected' columns .*"
                                        "pairs.jsonl has: text$"):
        forms.instruction_form(plain, "preference", settings)
    with pytest.raises(UserError, match="pairs.jsonl holds preference pairs .* llama-tiny is a sequence "
                                        "classifier: pass a causal LM$"):
        forms.instruction_form(pairs, "sequence_classification", settings)


def test_a_plain_answer_that_ends_with_the_end_of_text_token_gets_no_second_one():
    tok = tokenizer()
    row = {"prompt": "Beautiful is better than", "chosen": f" ugly.{EOS}", "rejected": " the moon."}
    encoded = preference.encode_row(tok, row, "r", BIG)
    p = encoded["prompt"]
    assert tok.decode(encoded["chosen"][p:]) == f" ugly.{EOS}" and tok.decode(encoded["rejected"][p:]) == \
        f" the moon.{EOS}"
