"""Tool use in chats (app/data/tools.py through app/data/chat.py): public rows with tool calls and results labelled
token by token on the assistant's turns alone, tools as JSON text or a list, null keys datasets adds left out, parts
other than text refused in one line, ShareGPT's function_call and observation turns."""
import json

import datasets
import pytest

from app.data import chat, conversations, tools
from app.data.tokenizers import byte_tokenizer
from app.errors import UserError
from conftest import REPO

EOS = "<|endoftext|>"


def tokenizer():
    made = byte_tokenizer()
    chat.ensure_template(made)
    return made


TOOLS = REPO / "tests" / "data" / "tools"
BIG = 100_000
TOOL_SPEAKERS = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}


def written_out(line: str) -> list:
    """[(text, labelled)] of a file's raw line as the default template renders it, written out here: the tools as
    JSON, then per turn a role header, its text, each call as <tool_call>{name, arguments}</tool_call> and the end;
    the labels on the assistant turns' text, calls and end."""
    raw = json.loads(line)
    tools = json.loads(raw["tools"]) if isinstance(raw.get("tools"), str) else raw.get("tools")
    out = [(f"<|tools|>\n{json.dumps(tools, ensure_ascii=False)}{EOS}", False)] if tools else []
    for m in raw.get("messages") or raw["conversations"]:
        if "from" in m:  # ShareGPT: a function_call turn's value is JSON of {name, arguments}
            role = TOOL_SPEAKERS[m["from"]]
            content, calls = ("", [json.loads(m["value"])]) if m["from"] == "function_call" else (m["value"], [])
        else:
            role, content, calls = m["role"], m.get("content") or "", [c["function"] for c in m.get("tool_calls", [])]
        for call in calls:
            arguments = json.loads(call["arguments"]) if isinstance(call["arguments"], str) else call["arguments"]
            content += f"<tool_call>{json.dumps({'name': call['name'], 'arguments': arguments})}</tool_call>"
        out += [(f"<|{role}|>\n", False), (content + EOS, role == "assistant")]
    return out


@pytest.mark.parametrize("name", ["foundry-stock_toolcall-openai.jsonl", "xtuner-qwen35_tokenize-openai.jsonl",
                                  "llamafactory-glaive_toolcall_en_demo-sharegpt.jsonl"])
def test_public_tool_calling_rows_are_labelled_on_the_calls_and_answers_only(name):
    """Every row, read as the app reads files, token by token: the tools block and the tools' results unlabelled,
    each assistant turn's text, calls and end labelled (ids compared: the xtuner rows' Chinese is several bytes a
    character)."""
    tok, lines = tokenizer(), (TOOLS / name).read_text(encoding="utf-8").splitlines()
    rows = datasets.load_dataset("json", data_files=str(TOOLS / name), split="train")
    assert len(rows) == len(lines)
    for i, (row, line) in enumerate(zip(rows, lines)):
        form = conversations.form_of(rows.column_names)
        ids, labels, _, cut = chat.encode_row(tok, row, form, f"row {i}", BIG, False)
        want_ids, want_labels = [], []
        for piece, answer in written_out(line):
            tokens = tok(piece, add_special_tokens=False)["input_ids"]
            want_ids, want_labels = want_ids + tokens, want_labels + (tokens if answer else [chat.IGNORE] * len(tokens))
        assert ids == want_ids and labels == want_labels and not cut, f"{name} line {i + 1}"


def test_tools_as_json_text_or_a_list_render_the_same_and_null_keys_vanish():
    """datasets gives every dict of a column every key any row has, null where it had none: those keys are not
    the row's, in the tools or in a call's arguments."""
    tok = tokenizer()
    row = json.loads((TOOLS / "foundry-stock_toolcall-openai.jsonl").read_text().splitlines()[0])
    as_text = {**row, "tools": json.dumps(row["tools"])}
    with_nulls = json.loads(json.dumps(row))
    with_nulls["tools"][0]["function"]["parameters"]["properties"]["symbol"]["enum"] = None
    with_nulls["tools"][1]["strict"] = None
    with_nulls["messages"][2].update(content=None, tool_calls=[{"function": {
        "name": "get_last_nday_stock_price", "arguments": {"symbol": "GS", "period": "1d", "interval": None}}}])
    encoded = [chat.encode_row(tok, r, "messages", "r", BIG, False) for r in (row, as_text, with_nulls)]
    assert encoded[0] == encoded[1] == encoded[2]
    assert tok.decode(encoded[0][0]).startswith('<|tools|>\n[{"type": "function", "function": {"name": "get_curr')


def test_content_parts_other_than_text_are_refused_in_one_line():
    """LLaMA-Factory's v1 rows hold reasoning and tool calls as parts of the content; the app reads text parts
    only, and says which parts a row holds rather than training on a part of the turn."""
    name = "llamafactory-reason_tool_use_demo_50-parts.jsonl"
    rows = datasets.load_dataset("json", data_files=str(TOOLS / name), split="train")
    lines = (TOOLS / name).read_text(encoding="utf-8").splitlines()
    for i, (row, line) in enumerate(zip(rows, lines)):
        first = next(m for m in json.loads(line)["messages"] if any(p["type"] != "text" for p in m["content"]))
        kinds = ", ".join(sorted({p["type"] for p in first["content"]}))
        with pytest.raises(UserError) as error:
            chat.encode_row(tokenizer(), row, "messages", f"row {i}", BIG, False)
        said = str(error.value)
        assert said.startswith(f"row {i}: a turn of role assistant holds parts of type {kinds};") and "\n" not in said
        assert "reasoning" in kinds and ("tool_call" in kinds or '"tool_call"' not in line)


def test_sharegpt_function_call_and_observation_turns_are_a_call_and_its_result():
    row = json.loads((TOOLS / "llamafactory-glaive_toolcall_en_demo-sharegpt.jsonl").read_text().splitlines()[0])
    assert conversations.turns(row["conversations"], "r", "its conversations") == [
        {"role": "user", "content": row["conversations"][0]["value"]},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "calculate_tip", "arguments": {"bill_amount": 100, "tip_percentage": 15}}}]},
        {"role": "tool", "content": '{"tip_amount": 15}'},
        {"role": "assistant", "content": "The tip amount for your bill is $15."}]


def test_a_call_is_read_with_or_without_its_function_wrapper_and_its_arguments_as_an_object():
    wrapped = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1, "y": null}'}}
    bare = {"name": "f", "arguments": {"x": 1}}
    assert tools.calls([wrapped], "r") == [{"id": "call_1", "type": "function",
                                             "function": {"name": "f", "arguments": {"x": 1}}}]
    assert tools.calls(json.dumps(bare), "r") == [{"type": "function",
                                                   "function": {"name": "f", "arguments": {"x": 1}}}]
    assert tools.offered({"tools": "[]"}, "r") is None and tools.offered({}, "r") is None
    with pytest.raises(UserError, match="r: its tools are not a list of tool descriptions"):
        tools.offered({"tools": '{"name": "f"}'}, "r")
