"""A row of instruction data as turns the chat template takes, from each public form: chats (`messages`, OpenAI's
fine-tuning rows with their per-turn `weight` and legacy `function_call`), ShareGPT's `conversations` with the
`system` column LLaMA-Factory gives them, and Alpaca's instruction, input and output with its `system` and
`history` columns; which assistant turns the loss learns."""
import math

from app.data import tools
from app.errors import UserError

# ShareGPT's speakers (axolotl, LLaMA-Factory and FastChat read its `conversations` of {"from", "value"} turns), and
# LLaMA-Factory's for tool use: a function_call turn holds the call as JSON, an observation turn the tool's result
SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
            "function_call": "assistant", "observation": "tool", "tool": "tool"}
SKIPPED = "skipped"
"""A turn's mark, taken out before the template renders it: OpenAI's `"weight": 0`, an answer the loss leaves out."""


def form_of(columns) -> str:
    """'messages', 'conversations' (ShareGPT), 'prompt_completion' or 'alpaca' (instruction, input, output) when
    the columns hold instruction data, else ''."""
    if "messages" in columns or "conversations" in columns:
        return "messages" if "messages" in columns else "conversations"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if "instruction" in columns and "output" in columns:
        return "alpaca"
    return ""


def as_text(value):
    """A cell as text where a file typed it as a number (a CSV's `4`, JSON's "output": 4); anything else as it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return None  # an empty CSV cell
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def alpaca_turns(row: dict, index: str) -> list:
    """An Alpaca row as a chat: alpaca_prompt's turns, then the output from the assistant."""
    output = as_text(row.get("output"))
    if not isinstance(output, str) or not output:
        raise UserError(f"{index}: its instruction or output is empty or not text")
    return alpaca_prompt(row, index) + [{"role": "assistant", "content": output}]


def alpaca_prompt(row: dict, index: str) -> list:
    """An Alpaca row's turns before its answer: its system text if any, its history's [question, answer] pairs
    (LLaMA-Factory's, each answer learned too), the instruction (and its input, after a blank line) from the user."""
    instruction, given = as_text(row.get("instruction")), as_text(row.get("input"))
    if not isinstance(instruction, str):
        raise UserError(f"{index}: its instruction or output is empty or not text")
    asked = instruction + (f"\n\n{given}" if isinstance(given, str) and given else "")
    before = []
    for pair in row.get("history") or []:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise UserError(f"{index}: its history is not a list of [question, answer] pairs of text")
        before += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return with_system(row, before + [{"role": "user", "content": asked}])


def with_system(row: dict, messages: list) -> list:
    """The row's `system` column (Alpaca's and LLaMA-Factory's ShareGPT rows) as a first turn, unless one leads."""
    system = as_text(row.get("system"))
    if not isinstance(system, str) or not system or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system}] + messages


def conversation(row: dict, form: str, index: str) -> tuple:
    """(turns, indices of the assistant turns the loss learns) of a row in a chat form, Alpaca's, or prompt and
    completion as turns (the completion's answers alone learned: the prompt's were given)."""
    first = 0
    if form == "alpaca":
        messages = alpaca_turns(row, index)
    elif form == "prompt_completion":
        asked = turns(row["prompt"], index, "its prompt")
        messages, first = asked + turns(row["completion"], index, "its completion"), len(asked)
    else:
        messages = with_system(row, turns(row[form], index, f"its {form}"))
    answers = [i for i in range(first, len(messages))
               if messages[i]["role"] == "assistant" and not messages[i].get(SKIPPED)]
    if not answers:
        raise UserError(f"{index} has no assistant turn to learn from; every conversation needs at least one "
                        f"(without \"weight\": 0)")
    return messages, answers


def _text(content, row: str, role: str):
    """A turn's content: text as it is; parts ([{"type": "text", "text": ...}], LLaMA-Factory's "value" for
    "text") joined when all are text."""
    if not isinstance(content, list):
        return content
    texts = [part.get("text", part.get("value")) if isinstance(part, dict) and part.get("type") == "text" else None
             for part in content]
    if not all(isinstance(text, str) for text in texts):
        kinds = sorted({str(part.get("type")) if isinstance(part, dict) else type(part).__name__ for part in content})
        raise UserError(f"{row}: a turn of role {role} holds parts of type {', '.join(kinds)}; only text parts "
                        f"({{\"type\": \"text\", \"text\": ...}}) are read")
    return "".join(texts)


def _turn(m: dict, row: str) -> dict:
    """One turn as the chat template takes it: role, text content, tool calls and their ids where given (OpenAI's
    legacy function_call and function role as today's tool call and tool), and whether the loss skips it."""
    if m.get("role"):
        role = "tool" if m["role"] == "function" else m["role"]
        turn = {"role": role, "content": _text(m.get("content"), row, role)}
        turn.update({k: m[k] for k in ("name", "tool_call_id") if m.get(k) is not None})
        calls = m.get("tool_calls") or m.get("function_call")
    else:
        turn = {"role": SPEAKERS.get(m["from"], m["from"]), "content": m.get("value")}
        calls = m.get("value") if m["from"] == "function_call" else None
        turn["content"] = "" if calls else turn["content"]
    if calls:
        turn["tool_calls"] = tools.calls(calls, row)
        turn["content"] = turn["content"] if turn["content"] is not None else ""
    if turn["content"] is None:
        raise UserError(f"{row}: a turn of role {turn['role']} has no content; give it text (an assistant turn that "
                        f"calls tools may leave it empty)")
    if m.get("weight") not in (None, 0, 1) or (m.get("weight") == 0 and turn["role"] != "assistant"):
        raise UserError(f"{row}: a turn's \"weight\" is 0 or 1, and 0 only on an assistant turn (OpenAI's rule); "
                        f"got {m['weight']!r} on a {turn['role']} turn")
    return {**turn, SKIPPED: True} if m.get("weight") == 0 else turn


def turns(value, row: str, what: str) -> list:
    """A list of turns, checked; ShareGPT's {from, value} turns are read as such."""
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) and (m.get("role") or m.get("from"))
                                                           for m in value):
        raise UserError(f"{row}: {what} is not a list of turns like "
                        f"{{\"role\": \"user\", \"content\": \"...\"}}")
    return [_turn(m, row) for m in value]
