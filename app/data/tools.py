"""Tool use in chats: the tools a row offers and the calls an assistant turn makes, as chat templates take them
(docs/instruction-tuning.md, "Tool calls")."""
import json

from app.errors import UserError


def parsed(value, row: str, what: str):
    """A JSON text parsed (other values as they are), with the keys whose value is null left out at every depth:
    datasets gives every row of a column every key any row has, null where it had none."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise UserError(f"{row}: {what} is not valid JSON: {value[:80]!r}") from None
    return _no_nulls(value)


def _no_nulls(value):
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    return [_no_nulls(v) for v in value] if isinstance(value, list) else value


def offered(row: dict, index: str):
    """The row's `tools` column (a list, or JSON text of one), or None."""
    tools = parsed(row.get("tools"), index, "its tools")
    if tools in (None, []):
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise UserError(f"{index}: its tools are not a list of tool descriptions like "
                        f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    return tools


def calls(given, row: str) -> list:
    """Tool calls as chat templates take them: {"type": "function", "function": {"name", "arguments": {...}}}."""
    given = parsed(given, row, "a tool call")
    out = []
    for call in given if isinstance(given, list) else [given]:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise UserError(f"{row}: a tool call without a function name: {str(call)[:80]}")
        arguments = parsed(function.get("arguments", {}), row, "a tool call's arguments")  # a dict, as templates take
        kept = {k: v for k, v in call.items() if k != "function"} if "function" in call else {}  # its id
        out.append({**kept, "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return out
