"""Instruction data: rows of chats (`messages`) or of `prompt` and `completion`, rendered with the tokenizer's chat
template, tokenized, and labelled on the answers only (every assistant turn), or on the whole text.

A row becomes (input ids, labels): the rendered text cut into pieces at the start and end of each answer, each piece
tokenized on its own (as the prompt is at inference, before the model answers), labels -100 outside the answers.
"""
import functools

import numpy as np
import torch

from app.data import conversations, tools
from app.data.samples import Samples
from app.errors import UserError, first_line

IGNORE = -100  # a label the loss leaves out (transformers' convention)
ROLES = ("system", "user", "assistant", "tool")
# The template a tokenizer without one gets (docs/data-and-models.md, "Instruction data"), saved with it so the exported
# model answers in the format it learned: the tools offered, as JSON, in a first turn of their own; each turn a role
# header, its text, each of its tool calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, and the
# end-of-text token; a tool's result is a turn of the role tool.
DEFAULT_TEMPLATE = (
    "{%- if tools %}{{- '<|tools|>\n' + (tools | tojson) + eos_token }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('role ' + message['role'] + ' is not one of system, user, assistant, tool') }}{%- endif %}"
    "{%- if message['content'] is not string %}"
    "{{- raise_exception('a ' + message['role'] + ' turn whose content is not text') }}{%- endif %}"
    "{{- '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{{- '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '</tool_call>' }}{%- endfor %}"
    "{{- eos_token }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}")


def ensure_template(tokenizer) -> bool:
    """Give a tokenizer without a chat template the default one; True if it got it."""
    if tokenizer.chat_template:
        return False
    tokenizer.chat_template = DEFAULT_TEMPLATE
    return True


def render(tokenizer, messages: list, generation: bool, row: str, tools=None) -> str:
    """The turns as the chat template renders them (generation: with the prompt of the answer to come)."""
    messages = [{k: v for k, v in m.items() if k != conversations.SKIPPED} for m in messages]  # the loss's mark alone
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)
    except Exception as e:  # jinja's TemplateError, or a message that is not a dict
        raise UserError(f"{row}: the chat template cannot render it ({first_line(e)}); "
                        f"each turn needs a role ({', '.join(ROLES)}) and text content") from None


def pieces(tokenizer, row: dict, form: str, index: str) -> list:
    """[(text, is_answer)] whose texts join to the whole rendered row; index names the row in errors."""
    prompt, completion = conversations.as_text(row.get("prompt")), conversations.as_text(row.get("completion"))
    if form == "prompt_completion" and isinstance(prompt, str):
        if not isinstance(completion, str) or not completion:
            raise UserError(f"{index}: its completion is empty or not text")
        if not prompt:  # the answer's first token would follow nothing: never trained, and no prompt to preview
            raise UserError(f"{index}: its prompt is empty; give every row a prompt, or train on plain text rows")
        eos = tokenizer.eos_token or ""
        return [(prompt, False), (completion if eos and completion.endswith(eos) else completion + eos, True)]  # one
    messages, answers = conversations.conversation(row, form, index)
    offered = tools.offered(row, index)
    whole, cuts = render(tokenizer, messages, False, index, offered), [0]
    for i in answers:
        start = render(tokenizer, messages[:i], True, index, offered)
        end = _answer_end(whole, render(tokenizer, messages[:i + 1], False, index, offered), tokenizer.eos_token)
        if not whole.startswith(start) or end < 0 or len(start) < cuts[-1]:
            raise UserError(f"the chat template does not render the start of a conversation as the start of the "
                            f"whole ({index}): it rewrites earlier turns; pass --tokenizer with one that does not")
        cuts += [len(start), end]
    cuts.append(len(whole))
    return [(whole[a:b], k % 2 == 1) for k, (a, b) in enumerate(zip(cuts, cuts[1:])) if b > a or k % 2 == 1]


def _answer_end(whole: str, end: str, eos: str) -> int:
    """Where in whole the answer ends that `end` (the conversation rendered up to it) closes: len(end), or before
    the end token a template closes a conversation with in place of a turn's close (Phi-3 writes it after the last
    turn only, OLMo in place of <|im_end|>), where whole goes on otherwise; -1 if neither."""
    if whole.startswith(end):
        return len(end)
    closed = bool(eos) and end.endswith(eos) and whole.startswith(end[:-len(eos)])
    return len(end) - len(eos) if closed else -1


@functools.lru_cache(maxsize=16)  # a tokenizer is asked once, however many rows it tokenizes
def start_ids(tokenizer) -> tuple:
    """The ids the tokenizer puts before plain text (Llama's <|begin_of_text|>, Gemma's and Mistral's <bos>), which
    TRL's trainers and transformers' run_clm keep: [] where it adds none, and where its start is its end-of-text
    token (GPT-2's family, whose <|endoftext|> ends documents and begins none). A chat template writes its own."""
    plain, full = (tokenizer("a", add_special_tokens=special)["input_ids"] for special in (False, True))
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
    return tuple(token for token in full[:at] if token != tokenizer.eos_token_id)


def encode_row(tokenizer, row: dict, form: str, index: str, block: int, whole_text: bool) -> tuple:
    """(input ids, labels, first answer's [start, end) in tokens, cut): the row's tokens up to block, labels on its
    answers (all of it when whole_text); a row of plain text (no chat template) after the start_ids."""
    plain = form == "prompt_completion" and isinstance(conversations.as_text(row.get("prompt")), str)
    ids = list(start_ids(tokenizer)) if plain else []
    labels, first = [IGNORE] * len(ids), []
    for text, answer in pieces(tokenizer, row, form, index):
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        if answer and not first:
            first = [min(len(ids), block), min(len(ids) + len(tokens), block)]
        ids += tokens
        labels += tokens if answer or whole_text else [IGNORE] * len(tokens)
    return ids[:block], labels[:block], first, len(ids) > block


def answer_tokens(labels) -> int:
    """Tokens a row's loss covers: labelled positions after the first (the first is never predicted)."""
    return sum(1 for y in labels[1:] if y != IGNORE)


def encoder(tokenizer, form: str, block: int, whole_text: bool, what: str):
    """The batched map function: rows to input_ids, labels, first answer, whether each was cut and answer-token
    counts; what names the split in errors."""
    def encode(batch, indices):
        out = {"input_ids": [], "labels": [], "answer": [], "cut": [], "units": []}
        columns = list(batch)
        for n, index in enumerate(indices):
            where = f"row {index} of the {what} instruction data"
            encoded = encode_row(tokenizer, {c: batch[c][n] for c in columns}, form, where, block, whole_text)
            for key, value in zip(out, (*encoded, answer_tokens(encoded[1]))):
                out[key].append(value)
        return out
    return encode


def padded(ids, labels, length: int, pad_id: int) -> tuple:
    """(input ids, labels) of one row padded on the right to length: padding is never a label."""
    padded_ids = torch.full((length,), pad_id, dtype=torch.long)
    padded_labels = torch.full((length,), IGNORE, dtype=torch.long)
    padded_ids[:len(ids)], padded_labels[:len(labels)] = torch.as_tensor(ids), torch.as_tensor(labels)
    return padded_ids, padded_labels


def packed_block(rows: list, block: int, pad_id: int) -> tuple:
    """((input ids, position ids), labels) of rows [(ids, labels), ...] packed into one block (PackedRows)."""
    ids = torch.full((block,), pad_id, dtype=torch.long)
    labels = torch.full((block,), IGNORE, dtype=torch.long)
    positions = torch.zeros(block, dtype=torch.long)
    at = 0
    for row_ids, row_labels in rows:
        n = len(row_ids)
        ids[at:at + n], labels[at + 1:at + n] = torch.as_tensor(row_ids), torch.as_tensor(row_labels)[1:]
        positions[at:at + n] = torch.arange(n)
        at += n
    positions[at:] = torch.arange(block - at)  # the padding: one more sequence, never a label
    return (ids, positions), labels


class AnswerRows(Samples):
    """(input ids, labels) padded on the right to one length: the causal attention never lets a real token see
    the padding after it, and padding is never a label. units: each row's answer tokens, for the loss's weights."""

    def __init__(self, dataset, pad_id: int, length: int):
        self.dataset, self.pad_id, self.length = dataset.with_format("torch"), pad_id, length
        self.units = list(dataset["units"])

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        row = self.dataset[i]
        return padded(row["input_ids"], row["labels"], self.length, self.pad_id)

    def per_sample(self) -> dict:
        """Rows and real (not padding) tokens per sample, on average over the set."""
        return {"rows": 1.0, "real_tokens": float(token_counts(self.dataset).mean())}

    def prompt(self, i: int) -> tuple:
        """(prompt ids, answer ids) of row i: the tokens before its first answer, and that answer."""
        row = self.dataset[i]
        ids, (start, end) = row["input_ids"].tolist(), row["answer"].tolist()
        return ids[:start], ids[start:end]


def token_counts(dataset, column: str = "input_ids") -> np.ndarray:
    """Each row's tokens in the column, counted from its offsets (no token read into Python)."""
    import pyarrow.compute as pc
    return np.asarray(pc.list_value_length(dataset.data.column(column)).to_numpy(zero_copy_only=False), np.int64)


def pack_order(lengths, block: int) -> list:
    """Rows (by index) grouped into blocks of at most block tokens: first fit, longest rows first, so the blocks
    come out nearly full; every row in exactly one block, in the same order on every rank. The first block with
    room is found in a tree of the blocks' room (the most of any block below each node): n log n for n rows, where
    a scan of the blocks took minutes on a few hundred thousand."""
    lengths = np.asarray(lengths, dtype=np.int64)
    size = 1 << max(0, int(len(lengths) - 1).bit_length())
    room = np.full(2 * size, block, dtype=np.int64)  # leaves size..2*size: blocks, opened or not (all room)
    blocks = []
    for i in np.lexsort((np.arange(len(lengths)), -lengths)).tolist():  # longest first, then by index
        n, node = int(lengths[i]), 1
        if room[1] < n:  # a row longer than the block (none are cut so): a block of its own
            node = size + len(blocks)
        while node < size:
            node = 2 * node if room[2 * node] >= n else 2 * node + 1
        b = node - size
        if b == len(blocks):
            blocks.append([i])
        else:
            blocks[b].append(i)
        room[node] -= n
        while node > 1:
            node //= 2
            room[node] = max(room[2 * node], room[2 * node + 1])
    return blocks


class PackedRows(Samples):
    """Rows of an AnswerRows packed into blocks of `block` tokens: ((input ids, position ids), labels). Position
    ids restart at each row, which the model's attention reads as the rows' bounds (app/core/packing.py checks
    that it does); each row's first token is never a label, as when it stands alone, so a block's loss is its
    rows' answer tokens and units add up."""

    def __init__(self, rows: AnswerRows, block: int):
        self.rows, self.block = rows, block
        self.groups = pack_order(token_counts(rows.dataset), block)
        self.units = [sum(rows.units[i] for i in group) for group in self.groups]

    def __len__(self):
        return len(self.groups)

    def __getitem__(self, i):
        rows = (self.rows.dataset[index] for index in self.groups[i])
        return packed_block([(row["input_ids"], row["labels"]) for row in rows], self.block, self.rows.pad_id)

    def per_sample(self) -> dict:
        """Rows and real (not padding) tokens per block, on average over the set."""
        real = self.rows.per_sample()["real_tokens"] * len(self.rows)
        return {"rows": len(self.rows) / len(self), "real_tokens": real / len(self)}

    def prompt(self, i: int) -> tuple:
        """Row i's (prompt ids, answer ids), as AnswerRows gives them."""
        return self.rows.prompt(i)
