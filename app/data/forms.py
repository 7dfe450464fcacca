"""What a text source's rows hold (plain text, labelled text, instruction data, preference pairs) and the block they
are cut to: the same for loaded sets (text_sets.py) and streamed ones (stream.py)."""
from app.data import TextModel, conversations, preference
from app.errors import UserError
from app.settings import Settings

KINDS = {"explicit": "preference pairs", "implicit": "preference pairs", "": "text"}


def instruction_form(train, task: str, settings: Settings) -> str:
    """The form of a causal LM's rows: preference pairs' (app/data/preference.py) or instruction data's
    (app/data/chat.py) when they hold one, else ''; --task preference and --task instruction refuse rows without."""
    pairs = preference.form_of(train.column_names)
    if task == "preference" and not pairs:
        raise UserError(f"--task preference needs rows with 'chosen' and 'rejected' columns (and 'prompt' unless "
                        f"both start with it); {settings.dataset} has: {', '.join(train.column_names)}")
    if pairs and task == "sequence_classification" and not settings.text_column:
        raise UserError(f"{settings.dataset} holds preference pairs ('chosen' and 'rejected'), which train a causal "
                        f"language model; {settings.model} is a sequence classifier: pass a causal LM")
    if pairs and task in ("causal_lm", "preference") and not settings.text_column:
        return pairs
    chats = task in ("causal_lm", "instruction") and not settings.text_column
    form = conversations.form_of(train.column_names) if chats else ""
    if task == "instruction" and not form:
        raise UserError(f"--task instruction needs rows with a 'messages' column (chats), 'conversations' (ShareGPT), "
                        f"'prompt' and 'completion', or 'instruction' and 'output' (Alpaca); {settings.dataset} has: "
                        f"{', '.join(train.column_names)}")
    return form


def block_for(settings: Settings, model: TextModel, tokenizer) -> int:
    """The block rows are cut to, checked against the model's embedding and positions."""
    if len(tokenizer) > model.vocab_size:
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens but {settings.model} embeds only "
                        f"{model.vocab_size}; use the model's own tokenizer, or --tokenizer bytes")
    block = settings.block_size or min(model.max_positions, 1024)
    if block > model.max_positions:
        raise UserError(f"--block_size {block} is longer than {settings.model}'s {model.max_positions} positions; "
                        f"pass --block_size {model.max_positions} or less")
    return block


def kind_of(forms: list, names: list, task: str) -> str:
    """What the sources make together: preference, instruction, or the task asked for (plain or labelled text)."""
    kinds = [KINDS.get(form, "instruction data") for form in forms]
    if len(set(kinds)) > 1:
        raise UserError("the --dataset sources and held-out files hold different kinds of rows (" + ", ".join(
            f"{n}: {k}" for n, k in zip([*names, "--eval_file"], kinds)) + "); one run trains one kind")
    return "preference" if kinds[0] == "preference pairs" else "instruction" if forms[0] else task
