"""Instruction data: chats and prompt/completion rows rendered with the chat template, labelled on the answers only
(every assistant turn), cut to the block with the count said once, the default template saved with the tokenizer,
and one line for each kind of bad row."""
import json

import datasets
import pytest
import torch

from app.data import TextModel, chat, conversations, text, text_sets
from app.data.tokenizers import TOKENIZER_DIR, byte_tokenizer, run_tokenizer
from app.errors import UserError
from app.settings import Settings
from conftest import REPO, started_tokenizer

EOS = "<|endoftext|>"
TWO_TURNS = {"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2?"},
                          {"role": "assistant", "content": "3"}, {"role": "user", "content": "and 2+2?"},
                          {"role": "assistant", "content": "4"}]}


def tokenizer():
    made = byte_tokenizer()
    assert chat.ensure_template(made) and not chat.ensure_template(made), "given once, kept after"
    return made


def labelled(tok, ids, labels) -> str:
    return tok.decode([i for i, y in zip(ids, labels) if y != chat.IGNORE])


def test_every_assistant_turn_is_labelled_and_nothing_else():
    tok = tokenizer()
    ids, labels, first, cut = chat.encode_row(tok, TWO_TURNS, "messages", "row 0", 1000, whole_text=False)
    assert tok.decode(ids) == tok.apply_chat_template(TWO_TURNS["messages"], tokenize=False)
    assert labelled(tok, ids, labels) == f"3{EOS}4{EOS}", "the answers and the end of each, no prompt"
    assert tok.decode(ids[:first[0]]) == f"<|system|>\nAdd.{EOS}<|user|>\n1+2?{EOS}<|assistant|>\n"
    assert tok.decode(ids[first[0]:first[1]]) == f"3{EOS}" and not cut
    assert chat.answer_tokens(labels) == 4
    ids, whole, _, _ = chat.encode_row(tok, TWO_TURNS, "messages", "row 0", 1000, whole_text=True)
    assert whole == ids, "--train_on_prompt labels the whole text"


def test_prompt_and_completion_rows_plain_and_conversational():
    tok = tokenizer()
    ids, labels, _, _ = chat.encode_row(tok, {"prompt": "2+2=", "completion": "4"}, "prompt_completion", "r", 99,
                                        False)
    assert tok.decode(ids) == f"2+2=4{EOS}" and labelled(tok, ids, labels) == f"4{EOS}"
    ended = chat.encode_row(tok, {"prompt": "2+2=", "completion": f"4{EOS}"}, "prompt_completion", "r", 99, False)
    assert ended[0] == ids, "a completion that ends with the end token gets no second one (as TRL's SFT adds it)"
    row = {"prompt": TWO_TURNS["messages"][:4], "completion": TWO_TURNS["messages"][4:]}
    ids, labels, _, _ = chat.encode_row(tok, row, "prompt_completion", "r", 999, False)
    assert tok.decode(ids) == tok.apply_chat_template(TWO_TURNS["messages"], tokenize=False)
    assert labelled(tok, ids, labels) == f"4{EOS}", "the completion only: the prompt's answer was given"


def test_plain_text_opens_with_the_tokenizers_own_start_token_as_trl_tokenizes_it():
    """TRL and transformers' run_clm call the tokenizer on plain text, which puts Llama's, Gemma's or Mistral's
    start token first; GPT-2's family starts with its end of text, which separates and starts nothing."""
    llama_like = started_tokenizer()
    assert chat.start_ids(llama_like) == (256,) and chat.start_ids(byte_tokenizer()) == ()
    assert chat.start_ids(started_tokenizer("$A </s>")) == (), "T5's end token comes after"
    ids, labels, first, _ = chat.encode_row(llama_like, {"prompt": "2+2=", "completion": "4"}, "prompt_completion",
                                            "r", 99, False)
    assert llama_like.decode(ids) == "<s>2+2=4</s>" and labels[0] == chat.IGNORE
    assert llama_like.decode(ids[first[0]:first[1]]) == "4</s>"
    chat.ensure_template(llama_like)
    chatted, _, _, _ = chat.encode_row(llama_like, TWO_TURNS, "messages", "r", 999, False)
    assert chatted[0] != 256, "a chat template writes its own start (the default one: none)"


def test_alpaca_rows_read_as_a_user_turn_and_an_answer():
    """Alpaca's rows (LLaMA-Factory's default format): the instruction and its input from the user, the output
    from the assistant, the system text first if there is one."""
    tok = tokenizer()
    row = {"instruction": "Add.", "input": "1+2", "output": "3", "system": ""}
    as_chat = {"messages": [{"role": "user", "content": "Add.\n\n1+2"}, {"role": "assistant", "content": "3"}]}
    assert chat.encode_row(tok, row, "alpaca", "r", 999, False) == chat.encode_row(tok, as_chat, "messages", "r",
                                                                                      999, False)
    with pytest.raises(UserError, match="r: its instruction or output is empty or not text"):
        chat.encode_row(tok, {**row, "output": ""}, "alpaca", "r", 999, False)


def test_sharegpt_conversations_read_as_chats():
    """ShareGPT's turns ({"from": "human" | "gpt" | "system", "value": ...}) render as the same chat does."""
    tok = tokenizer()
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    shared = {"conversations": [{"from": speakers[m["role"]], "value": m["content"]} for m in TWO_TURNS["messages"]]}
    assert chat.encode_row(tok, shared, "conversations", "r", 999, False) == \
        chat.encode_row(tok, TWO_TURNS, "messages", "r", 999, False)


@pytest.mark.parametrize("row, said", [
    ({"messages": [{"role": "ipython", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "the chat template cannot render it (role ipython is not one of system, user, assistant, tool)"),
    ({"messages": [{"role": "user", "content": "x"}]}, "has no assistant turn to learn from"),
    ({"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "y"}]},
     "a turn of role user holds parts of type str; only text parts"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 3}]},
     "a assistant turn whose content is not text"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]},
     "a tool call without a function name"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{symbol: GS"}}]}]},
     "a tool call's arguments is not valid JSON: '{symbol: GS'"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "f(1)"}]},
     "a tool call is not valid JSON: 'f(1)'"),
    ({"messages": "hello"}, "its messages is not a list of turns"),
    ({"prompt": "x", "completion": ""}, "its completion is empty or not text"),
    ({"prompt": "", "completion": "x"}, "its prompt is empty; give every row a prompt"),
])
def test_a_bad_row_is_one_line_naming_it(row, said):
    form = conversations.form_of(row.keys()) or "prompt_completion"
    with pytest.raises(UserError, match="^row 7 of the train instruction data") as error:
        chat.encoder(tokenizer(), form, 100, False, "train")({k: [v] for k, v in row.items()}, [7])
    assert said in str(error.value) and "\n" not in str(error.value)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    """Some templates drop what earlier assistant turns said (reasoning, for one): the rendered start of a
    conversation is then not the start of the whole, and the answers cannot be found in it."""
    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[earlier]"
                         "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    with pytest.raises(UserError, match="does not render the start of a conversation as the start of the whole"):
        chat.pieces(tok, TWO_TURNS, "messages", "row 0")


# microsoft/Phi-3.5-mini-instruct's template, as published: the end-of-text token after the last turn only
PHI35 = ("{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}{{'<|system|>\\n' + "
         "message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] "
         "+ '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + "
         "'<|end|>\\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}"
         "{{ eos_token }}{% endif %}")


# The shape of OLMo's template (allenai/open-instruct's "olmo"): an assistant turn closes with <|im_end|> but the last,
# which closes with the end-of-text token in its place
OLMO = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' + m['content'] }}"
        "{% if not loop.last %}{{ '<|im_end|>\\n' }}{% else %}{{ eos_token }}{% endif %}{% else %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
        "{% if loop.last and add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("template, earlier, last", [(PHI35, "3<|end|>\n", "4<|end|>\n"), (OLMO, "3", "4")])
def test_a_template_that_closes_a_conversation_otherwise_than_a_turn_labels_every_answer(template, earlier, last):
    """Phi-3's closes the last turn with <|end|> and its end-of-text token, earlier ones with <|end|> alone; OLMo's
    the last with that token in place of <|im_end|>: each answer is labelled as the whole renders it up to where
    that token would be, the last one with it."""
    tok = byte_tokenizer()
    tok.chat_template = template
    answers = [text for text, is_answer in chat.pieces(tok, TWO_TURNS, "messages", "row 0") if is_answer]
    assert answers == [earlier, last + tok.eos_token]
    assert "".join(text for text, _ in chat.pieces(tok, TWO_TURNS, "messages", "row 0")) == \
        tok.apply_chat_template(TWO_TURNS["messages"], tokenize=False)


def _rows(tmp_path, n=30):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "q" * (i % 7 + 1)},
                                                     {"role": "assistant", "content": "a" * (i % 5 + 1)}]}) + "\n"
                            for i in range(n)))
    return text.load_splits(str(path), "", "", 0.2, seed=0)[0]


def test_long_rows_are_cut_said_once_and_rows_left_without_an_answer_left_out(tmp_path, capsys):
    rows, tok = _rows(tmp_path), tokenizer()
    whole = text.instruction_rows(rows, tok, "messages", 1000, False, "train")
    assert len(whole) == len(rows) and "cut" not in capsys.readouterr().out
    longest = max(len(ids) for ids in whole["input_ids"])
    kept = text.instruction_rows(rows, tok, "messages", 28, False, "train")
    said = capsys.readouterr().out
    cut = sum(len(ids) > 28 for ids in whole["input_ids"])
    prompt_only = sum(first[0] >= 28 for first in whole["answer"])  # their answer starts past the cut
    assert said.count("rows are longer than the block of 28 tokens and were cut") == 1 and 0 < cut < len(rows)
    assert f"train: {cut} of {len(rows)} rows" in said and longest > 28
    assert all(len(ids) <= 28 for ids in kept["input_ids"]) and all(u > 0 for u in kept["units"])
    assert len(kept) == len(rows) - prompt_only and len(kept.data) == len(kept), "the table holds the kept rows"
    packed = chat.PackedRows(chat.AnswerRows(kept, tok.pad_token_id, 28), 64)
    assert sorted(i for group in packed.groups for i in group) == list(range(len(kept)))
    assert sum(packed.units) == sum(kept["units"])
    with pytest.raises(UserError, match="no train row keeps an answer token within the block of 4 tokens"):
        text.instruction_rows(rows, tok, "messages", 4, False, "train")


def test_rows_are_padded_on_the_right_and_padding_is_never_a_label(tmp_path):
    tok = tokenizer()
    encoded = text.instruction_rows(_rows(tmp_path), tok, "messages", 1000, False, "train")
    rows = chat.AnswerRows(encoded, tok.pad_token_id, 40)
    ids, labels = rows[0]
    n = len(encoded[0]["input_ids"])
    assert ids.shape == labels.shape == (40,) and (ids[n:] == tok.pad_token_id).all()
    assert (labels[n:] == chat.IGNORE).all() and rows.units[0] == int((labels[1:] != chat.IGNORE).sum())
    prompt, answer = rows.prompt(0)
    assert tok.decode(prompt).endswith("<|assistant|>\n") and tok.decode(answer).endswith(EOS)
    assert torch.equal(ids[:len(prompt) + len(answer)], torch.tensor(prompt + answer))


def test_a_tokenizer_without_a_template_is_saved_with_the_default(tmp_path, capsys):
    settings = Settings(model="llama-tiny", tokenizer="bytes")
    made = run_tokenizer(settings, TextModel("", 8192, 128), lambda: iter([]), tmp_path, chat=True)
    assert made.chat_template == chat.DEFAULT_TEMPLATE and "using the default" in capsys.readouterr().out
    from transformers import AutoTokenizer
    again = AutoTokenizer.from_pretrained(tmp_path / TOKENIZER_DIR)
    assert again.apply_chat_template(TWO_TURNS["messages"], tokenize=False) == \
        made.apply_chat_template(TWO_TURNS["messages"], tokenize=False)


def test_instruction_needs_one_of_the_two_forms(tmp_path):
    path = tmp_path / "plain.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i}", "source": "x"}) + "\n" for i in range(10)))
    settings = Settings(model="llama-tiny", task="instruction", dataset=str(path))
    with pytest.raises(UserError, match="--task instruction needs rows with a 'messages' column \\(chats\\), "
                                        "'conversations' \\(ShareGPT\\), 'prompt' and 'completion', or "
                                        "'instruction' and 'output' \\(Alpaca\\); .* has: text, source"):
        text_sets.build_text_sets(settings, TextModel("", 8192, 128), "instruction", tmp_path / "run")
