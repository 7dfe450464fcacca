"""Preference data: rows of two answers to one prompt, `chosen` and `rejected`, in the forms TRL documents (plain text
or lists of messages, the prompt in its own column or the shared start of both), rendered with the chat template.

A row becomes two token sequences, the prompt followed by each answer, labelled on the answer's tokens alone: the
prompt rendered as the model sees it before it answers (add_generation_prompt), each answer the rest of the whole
conversation's rendering, tokenized on its own as chat.py does.
"""
import numpy as np
import torch

from app.data import DataInfo, chat, conversations, text
from app.data.chat import IGNORE
from app.data.samples import Samples
from app.distributed import dist
from app.errors import UserError


PROMPTS = ("prompt", "conversations", "messages", "instruction")
"""Columns that hold a pair's prompt: TRL's prompt, ShareGPT's conversations or a chat's messages (LLaMA-Factory's
ranking rows), Alpaca's instruction (with its input, history and system columns)."""


def form_of(columns) -> str:
    """'explicit' (a prompt column, PROMPTS, beside chosen and rejected), 'implicit' (chosen and rejected hold whole
    texts or conversations that start alike), or '' when the rows are not preference pairs."""
    if "chosen" not in columns or "rejected" not in columns:
        return ""
    return "explicit" if any(column in columns for column in PROMPTS) else "implicit"


def _shared_start(chosen, rejected) -> int:
    """Where two texts, or two lists of turns, first differ; for texts, a space just before stays with the answers,
    and where one is the start of the other, its last character or turn does (TRL's rules for an implicit
    prompt)."""
    n, shorter = 0, min(len(chosen), len(rejected))
    while n < shorter and chosen[n] == rejected[n]:
        n += 1
    if n == shorter:  # one is the start of the other: its last character, or turn, stays an answer
        return max(n - 1, 0)
    if isinstance(chosen, str) and n > 0 and chosen[n - 1] == " ":
        n -= 1
    return n


def _as_turns(value, index: str, what: str) -> list:
    """A list of {role, content} turns; LLaMA-Factory's answers ({"from": "gpt", "value": ...}) are one turn."""
    return conversations.turns([value] if isinstance(value, dict) else value, index, what)


def _asked_within(chosen, rejected) -> bool:
    """Whether two lists of turns start alike with a user's turn: conversations that hold their prompt."""
    if not isinstance(chosen, list) or not isinstance(rejected, list):
        return False
    shared = chosen[:_shared_start(chosen, rejected)]
    return any(isinstance(turn, dict) and turn.get("role", turn.get("from")) in ("user", "human") for turn in shared)


def _prompt(row: dict, index: str):
    """The row's prompt: its text, or its turns (with the row's system column); None where the answers hold it."""
    if row.get("prompt") is None and row.get("conversations") is None and row.get("messages") is None and \
            row.get("instruction") is not None:
        return conversations.alpaca_prompt(row, index)
    prompt = next((row[key] for key in ("prompt", "conversations", "messages") if row.get(key) is not None), None)
    if isinstance(prompt, (list, dict)):
        return conversations.with_system(row, _as_turns(prompt, index, "its prompt"))
    return conversations.as_text(prompt)


def split_row(row: dict, index: str) -> tuple:
    """(prompt, chosen, rejected): three texts, or three lists of turns."""
    chosen, rejected = conversations.as_text(row["chosen"]), conversations.as_text(row["rejected"])
    prompt = _prompt(row, index)
    if isinstance(prompt, str) and not isinstance(chosen, str) and _asked_within(chosen, rejected):
        prompt = None  # UltraFeedback's form: the prompt's text beside conversations that hold it, as TRL reads it
    if isinstance(prompt, list) and isinstance(chosen, str) and isinstance(rejected, str):
        if not chosen or not rejected:  # Alpaca's and LLaMA-Factory's ranking rows: the answers are the reply's text
            raise UserError(f"{index}: its {'chosen' if not chosen else 'rejected'} answer is empty")
        chosen, rejected = ([{"role": "assistant", "content": answer}] for answer in (chosen, rejected))
    if isinstance(chosen, str) != isinstance(rejected, str) or (prompt is not None and
                                                                isinstance(prompt, str) != isinstance(chosen, str)):
        raise UserError(f"{index}: its prompt, chosen and rejected are not all text nor all lists of turns")
    if isinstance(chosen, str):
        if prompt is None:
            cut = _shared_start(chosen, rejected)
            prompt, chosen, rejected = chosen[:cut], chosen[cut:], rejected[cut:]
        return prompt, chosen, rejected
    chosen, rejected = _as_turns(chosen, index, "its chosen"), _as_turns(rejected, index, "its rejected")
    if prompt is None:
        cut = _shared_start(chosen, rejected)
        prompt, chosen, rejected = chosen[:cut], chosen[cut:], rejected[cut:]
    return prompt, chosen, rejected


def _rendered(tokenizer, prompt, answer, index: str, which: str) -> tuple:
    """(prompt text, answer text) as the template renders them, the answer the rest of the whole conversation."""
    if isinstance(answer, str):
        if not answer:
            raise UserError(f"{index}: its {which} answer is empty")
        eos = tokenizer.eos_token or ""
        return prompt, answer if answer.endswith(eos) else answer + eos
    if not any(turn["role"] == "assistant" for turn in answer):
        raise UserError(f"{index}: its {which} answer has no assistant turn after the prompt they share")
    start = chat.render(tokenizer, prompt, True, index) if prompt else ""
    whole = chat.render(tokenizer, prompt + answer, False, index)
    if not whole.startswith(start):
        raise UserError(f"the chat template does not render the prompt as the start of the whole conversation "
                        f"({index}); pass --tokenizer with one that does")
    return start, whole[len(start):]


def encode_row(tokenizer, row: dict, index: str, block: int) -> dict:
    """The row's prompt and answers as tokens cut to block: each answer's ids (prompt first) and labels, how many
    answer tokens each keeps, whether a cut was made, and whether the two answers are the same."""
    prompt, chosen, rejected = split_row(row, index)
    encoded = {}
    for which, answer in (("chosen", chosen), ("rejected", rejected)):
        start, text = _rendered(tokenizer, prompt, answer, index, which)
        asked = tokenizer(start, add_special_tokens=False)["input_ids"] if start else []
        asked = list(chat.start_ids(tokenizer)) + asked if isinstance(answer, str) else asked  # plain text
        said = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = (asked + said)[:block]
        encoded[which] = ids
        encoded[f"{which}_labels"] = ([IGNORE] * len(asked) + said)[:block]
        encoded[f"{which}_units"] = chat.answer_tokens(encoded[f"{which}_labels"])
        encoded["prompt"] = min(len(asked), block)
        encoded["cut"] = encoded.get("cut", False) or len(asked) + len(said) > block
    encoded["same"] = encoded["chosen"] == encoded["rejected"]
    return encoded


def encoder(tokenizer, block: int, what: str):
    """The batched map function of preference rows; what names the split in errors."""
    keys = ("chosen", "chosen_labels", "chosen_units", "rejected", "rejected_labels", "rejected_units", "prompt",
            "cut", "same")

    def encode(batch, indices):
        out = {key: [] for key in keys}
        for n, index in enumerate(indices):
            encoded = encode_row(tokenizer, {c: batch[c][n] for c in batch}, f"row {index} of the {what} "
                                 f"preference data", block)
            for key in keys:
                out[key].append(encoded[key])
        return out
    return encode


def _with_reference(rows, table):
    """rows with the column `reference` (float32 pairs) of table, under the fingerprint rows had: the reference file
    is keyed by the pairs (app/core/reference.py), which the column does not change."""
    import pyarrow as pa
    column = pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(table, dtype=np.float32).ravel()), 2)
    return rows.add_column("reference", column, new_fingerprint=rows._fingerprint)


class PairRows(Samples):
    """((the two sequences' ids, each padded on the right to length), (their labels, the reference's
    log-probabilities of the two answers)), chosen first. The pair is the loss's unit: a step's loss is a mean over
    its pairs. The log-probabilities are the rows' column `reference`, set once precomputed (add_reference, from
    app/core/reference.py); zeros until then, which only the micro batch search's trial steps read."""

    def __init__(self, dataset, pad_id: int, length: int):
        self.pad_id, self.length, self.units = pad_id, length, [1.0] * len(dataset)
        self.dataset = _with_reference(dataset.with_format("torch"), np.zeros((len(dataset), 2)))

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        row = self.dataset[i]
        ids = torch.full((2, self.length), self.pad_id, dtype=torch.long)
        labels = torch.full((2, self.length), IGNORE, dtype=torch.long)
        for k, which in enumerate(("chosen", "rejected")):
            ids[k, :len(row[which])], labels[k, :len(row[which])] = row[which], row[f"{which}_labels"]
        return ids, (labels, row["reference"])

    def add_reference(self, table):
        """Set the reference's log-probabilities of each pair's answers, [[chosen, rejected]] in row order."""
        fingerprint = self.dataset._fingerprint
        self.dataset = _with_reference(self.dataset.remove_columns(["reference"], new_fingerprint=fingerprint), table)

    @property
    def reference(self) -> torch.Tensor:
        """The column `reference` as a (rows, 2) tensor."""
        return self.dataset.select_columns(["reference"])[:]["reference"]

    def per_sample(self) -> dict:
        """Rows (pairs) and real (not padding) tokens per sample, on average over the set."""
        real = sum(len(ids) for which in ("chosen", "rejected") for ids in self.dataset.data.column(which).to_pylist())
        return {"rows": 1.0, "real_tokens": real / len(self)}

    def prompt(self, i: int) -> tuple:
        """(prompt ids, chosen answer ids) of row i, for the answers shown at each evaluation."""
        row = self.dataset[i]
        ids, start = row["chosen"].tolist(), int(row["prompt"])
        return ids[:start], ids[start:]


def pair_rows(dataset, tokenizer, block: int, what: str):
    """Pairs rendered and labelled on their answers (app/data/preference.py), cut to block tokens; says how many
    were cut, and leaves out (saying so) pairs whose two answers are the same or lost every answer token."""
    key = text.cache_key(dataset, tokenizer, "preference", block, tokenizer.chat_template)
    rows = text.mapped(dataset, encoder(tokenizer, block, what), key, what, "preference pairs", with_indices=True)
    kept = [bool(c and r) for c, r in zip(rows["chosen_units"], rows["rejected_units"])]
    cut, empty = sum(rows["cut"]), kept.count(False)
    same = sum(1 for k, s in zip(kept, rows["same"]) if k and s)
    if cut:
        dist.print0(f"{what}: {cut} of {len(rows)} pairs are longer than the block of {block} tokens and were cut"
                    f"{f'; {empty} lost every token of an answer and are left out' if empty else ''} (--block_size "
                    f"sets the block)")
    if same:
        dist.print0(f"{what}: {same} of {len(rows)} pairs have the same answer chosen and rejected (within the "
                    f"block); they teach nothing and are left out")
    if cut or same or empty:
        rows = rows.filter(lambda c, r, s: c > 0 and r > 0 and not s, input_columns=["chosen_units", "rejected_units",
                                                                                      "same"],
                           new_fingerprint=key + "-kept")
        rows = rows.flatten_indices(new_fingerprint=key + "-flat")
    if not len(rows):
        raise UserError(f"no {what} preference pair keeps two different answers within the block of {block} "
                        f"tokens; raise --block_size, or check the chosen and rejected columns")
    return rows


def pair_sets(train, eval_set, tokenizer, block: int, settings) -> tuple:
    """(train, held-out, DataInfo) of tokenized preference pairs (pair_rows), each answer padded to the longest."""
    if settings.packing == "on":
        raise UserError("--packing on packs instruction rows; preference pairs are not packed: leave --packing "
                        "auto or pass off")
    length = max(text.longest(rows, which) for rows in (train, eval_set) for which in ("chosen", "rejected"))
    sets = [PairRows(rows, tokenizer.pad_token_id, length) for rows in (train, eval_set)]
    return (*sets, DataInfo(0, task="causal_lm", vocab_size=len(tokenizer), seq_len=length))
