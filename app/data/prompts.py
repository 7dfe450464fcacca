"""Prompts for online RL (--task grpo): each row's `prompt`, plain text or a list of messages (rendered with the
chat template's generation prompt), tokenized once as TRL does (a text prompt after the tokenizer's start tokens,
app/data/chat.py's start_ids); the row's other columns go to the reward functions by name (app/core/rewards.py)."""
import torch

from app.data import DataInfo, TextModel, chat, conversations, sources, text
from app.data.forms import block_for
from app.data.samples import Samples
from app.data.tokenizers import run_tokenizer
from app.distributed import dist
from app.errors import UserError


GIVEN = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""What TRL gives every reward function by these names: a column of one of them would collide with it."""
NOT_PASSED = ("completion", "completion_ids")
"""Columns TRL keeps from the reward functions (a completion of the data, not the one sampled)."""


class PromptRows(Samples):
    """(the prompt's ids, left-padded to the set's length, [the row's index, its prompt's tokens]); the raw rows
    stay for the rewards. A sample is one prompt: the step samples its group of completions. repeats: the optimizer
    steps each window of prompts takes (--num_iterations; training only)."""

    def __init__(self, rows, pad_id: int, length: int, repeats: int = 1):
        self.rows, self.pad_id, self.length, self.repeats = rows, pad_id, length, repeats
        self.ids = rows["prompt_ids"]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        prompt = self.ids[i]
        ids = torch.full((self.length,), self.pad_id, dtype=torch.long)
        ids[self.length - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        return ids, torch.tensor([i, len(prompt)])

    def prompts(self, indices: list) -> list:
        """The rows' prompts as written: text, or a list of messages."""
        return [self.rows[int(i)]["prompt"] for i in indices]

    def columns(self, indices: list) -> dict:
        """The rows' other columns, by name: what the reward functions take as keyword arguments."""
        names = [c for c in self.rows.column_names if c not in ("prompt", "prompt_ids", *NOT_PASSED)]
        picked = [self.rows[int(i)] for i in indices]
        return {name: [row[name] for row in picked] for name in names}


def _prompt_text(tokenizer, value, row: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return chat.render(tokenizer, conversations.turns(value, row, "prompt"), True, row)
    raise UserError(f"{row}: the prompt is neither text nor a list of messages like "
                    f"{{\"role\": \"user\", \"content\": \"...\"}}")


def _encoded(dataset, tokenizer, what: str):
    """The rows with their prompt's token ids added (cached under a fingerprint of the data and tokenizer)."""
    def encode(batch, indices):
        plain = list(chat.start_ids(tokenizer))  # before a text prompt, as TRL's tokenizer call puts them
        ids = [(plain if isinstance(value, str) else []) +
               tokenizer(_prompt_text(tokenizer, value, f"{what} row {i}"), add_special_tokens=False)["input_ids"]
               for value, i in zip(batch["prompt"], indices)]
        empty = next((i for i, prompt in zip(indices, ids) if not prompt), None)
        if empty is not None:  # nothing to continue from: the completion's first token has no prompt token before it
            raise UserError(f"{what} row {empty}: its prompt is empty; give every row a prompt")
        return {**batch, "prompt_ids": ids}
    key = text.cache_key(dataset, tokenizer, "prompts", tokenizer.chat_template)
    cache = [f["filename"] for f in dataset.cache_files]
    rows = dataset.map(encode, batched=True, with_indices=True, new_fingerprint=key,
                       load_from_cache_file=bool(cache))
    dist.print0(f"{what}: {len(rows)} prompts")
    return rows


def _checked(train, held, settings) -> None:
    for rows, what in ((train, "--dataset"), (held, "the held-out rows")):
        if "prompt" not in rows.column_names:
            raise UserError(f"--task grpo needs rows with a 'prompt' column (text, or a list of messages), and any "
                            f"columns the reward functions read; {what} has: {', '.join(rows.column_names)}")
        taken = [c for c in rows.column_names if c in GIVEN and c not in NOT_PASSED]
        if taken:
            raise UserError(f"{what} has a column named {taken[0]!r}, the name of what every reward function is "
                            f"given beside the columns (TRL's {', '.join(GIVEN)}); rename the column")
        if "prompt_ids" in rows.column_names:
            raise UserError(f"{what} has a column named 'prompt_ids', where the app puts each prompt's token ids; "
                            f"rename the column")
    if len(sources.split_sources(settings.dataset)) > 1 or settings.streaming == "on":
        raise UserError("--task grpo reads one --dataset source, loaded whole: pass one source and --streaming off")


def prompt_sets(settings, model: TextModel, output_dir) -> tuple:
    """(train, held-out, DataInfo, tokenizer, 'grpo'): the prompts of both splits, left-padded to the longest, a
    sample's sequence that length plus --max_completion_length, within the model's positions."""
    with dist.main_process_first():
        train, held = text.load_splits(settings.dataset, settings.dataset_config, settings.eval_file,
                                       settings.eval_fraction, settings.seed,
                                       splits_named=(settings.dataset_train_split, settings.dataset_test_split))
        _checked(train, held, settings)
        chats = isinstance(train[0]["prompt"], list)
        tokenizer = run_tokenizer(settings, model, lambda: text.chat_texts(train, "prompt"), output_dir, chat=chats)
        train, held = _encoded(train, tokenizer, "train"), _encoded(held, tokenizer, "held-out")
    longest = max(text.longest(train, "prompt_ids"), text.longest(held, "prompt_ids"))
    room = block_for(settings, model, tokenizer) if settings.block_size else model.max_positions
    if longest + settings.max_completion_length > room:
        raise UserError(f"the longest prompt ({longest} tokens) and --max_completion_length "
                        f"{settings.max_completion_length} make {longest + settings.max_completion_length} tokens, "
                        f"more than the {room} the model reads{' (--block_size)' if settings.block_size else ''}; "
                        f"lower --max_completion_length or shorten the prompts")
    info = DataInfo(0, task="causal_lm", vocab_size=len(tokenizer),
                    seq_len=longest + settings.max_completion_length)
    pad = tokenizer.pad_token_id
    return (PromptRows(train, pad, longest, settings.num_iterations), PromptRows(held, pad, longest), info, tokenizer,
            "grpo")
