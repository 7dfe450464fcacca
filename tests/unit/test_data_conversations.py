"""A row of instruction data as turns (app/data/conversations.py): each public form read as its own documentation
writes it (OpenAI's fine-tuning rows with per-turn weights and legacy function calls, LLaMA-Factory's ShareGPT
`system` column and Alpaca `history`, numbers a file typed as numbers), and what cannot be read, one line."""
import pytest

from app.data import chat, conversations
from app.errors import UserError
from unit.test_data_chat import TWO_TURNS, labelled, tokenizer

EOS = "<|endoftext|>"


def _labelled(row, form=None) -> str:
    tok = tokenizer()
    ids, labels, _, _ = chat.encode_row(tok, row, form or conversations.form_of(row.keys()), "r", 999, False)
    return labelled(tok, ids, labels)


def test_the_form_is_found_from_the_columns():
    assert conversations.form_of(["messages", "id"]) == "messages"
    assert conversations.form_of(["prompt", "completion"]) == "prompt_completion"
    assert conversations.form_of(["conversations"]) == "conversations"
    assert conversations.form_of(["instruction", "input", "output"]) == "alpaca"
    assert conversations.form_of(["prompt", "text"]) == "" and conversations.form_of(["text"]) == ""


def test_an_answer_of_weight_0_is_context_not_learned_as_openais_fine_tuning_reads_it():
    """OpenAI's multi-turn rows: "weight": 0 on an assistant turn leaves it out of the loss, not out of the chat."""
    turns = [dict(m) for m in TWO_TURNS["messages"]]
    turns[2]["weight"], turns[4]["weight"] = 0, 1
    tok = tokenizer()
    ids, labels, first, _ = chat.encode_row(tok, {"messages": turns}, "messages", "r", 999, False)
    assert tok.decode(ids) == tok.apply_chat_template(TWO_TURNS["messages"], tokenize=False), "rendered whole"
    assert labelled(tok, ids, labels) == f"4{EOS}" and tok.decode(ids[first[0]:first[1]]) == f"4{EOS}"
    turns[4]["weight"] = 0
    with pytest.raises(UserError, match=r'has no assistant turn to learn from; .* \(without "weight": 0\)'):
        _labelled({"messages": turns})
    turns[4]["weight"], turns[1]["weight"] = 1, 0
    with pytest.raises(UserError, match=r'a turn\'s "weight" is 0 or 1, and 0 only on an assistant turn'):
        _labelled({"messages": turns})


def test_sharegpts_system_column_leads_the_chat_as_llamafactory_gives_it():
    shared = {"conversations": [{"from": "human", "value": "1+2?"}, {"from": "gpt", "value": "3"}], "system": "Add."}
    as_chat = {"messages": [{"role": "system", "content": "Add."}, *TWO_TURNS["messages"][1:3]]}
    tok = tokenizer()
    assert chat.encode_row(tok, shared, "conversations", "r", 999, False) == \
        chat.encode_row(tok, as_chat, "messages", "r", 999, False)
    led = {"conversations": [{"from": "system", "value": "Own."}, *shared["conversations"]], "system": "Add."}
    assert conversations.conversation(led, "conversations", "r")[0][0] == {"role": "system", "content": "Own."}


def test_alpacas_history_is_earlier_turns_whose_answers_are_learned_too():
    """LLaMA-Factory's Alpaca rows: [question, answer] pairs before the instruction, their answers learned."""
    row = {"instruction": "and 2+2?", "input": "", "output": "4", "system": "Add.", "history": [["1+2?", "3"]]}
    tok = tokenizer()
    assert chat.encode_row(tok, row, "alpaca", "r", 999, False) == \
        chat.encode_row(tok, TWO_TURNS, "messages", "r", 999, False)
    with pytest.raises(UserError, match="r: its history is not a list of \\[question, answer\\] pairs of text"):
        conversations.alpaca_turns({**row, "history": [["1+2?"]]}, "r")


def test_numbers_a_file_typed_as_numbers_are_read_as_the_text_they_were():
    """A CSV's `2+2=,4` (pandas reads 4 as an integer) and JSON's "output": 4 are rows of text."""
    assert _labelled({"prompt": "2+2=", "completion": 4}, "prompt_completion") == f"4{EOS}"
    assert _labelled({"instruction": "Double it.", "input": 6, "output": 12.0}) == f"12{EOS}"
    assert conversations.alpaca_turns({"instruction": "Halve 3.", "input": float("nan"), "output": 1.5}, "r") == [
        {"role": "user", "content": "Halve 3."}, {"role": "assistant", "content": "1.5"}], "an empty cell: no input"
    assert conversations.as_text(True) is True, "a flag is no text"


def test_a_turn_without_content_is_one_line_and_openais_legacy_function_call_is_a_tool_call():
    with pytest.raises(UserError, match="r: a turn of role assistant has no content; give it text"):
        _labelled({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]})
    legacy = [{"role": "user", "content": "Weather?"},
              {"role": "assistant", "content": None, "function_call": {"name": "weather", "arguments": "{}"}},
              {"role": "function", "name": "weather", "content": "sunny"},
              {"role": "assistant", "content": "Sunny."}]
    found = conversations.turns(legacy, "r", "its messages")
    assert found[1] == {"role": "assistant", "content": "",
                        "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {}}}]}
    assert found[2] == {"role": "tool", "content": "sunny", "name": "weather"}
    assert _labelled({"messages": legacy}).endswith(f"Sunny.{EOS}")
