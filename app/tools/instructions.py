"""Write a small instruction fine-tuning example: a tiny Llama-family model folder (random weights, its byte-level
tokenizer, no chat template) and chats in the usual `{"messages": [...]}` form asking for the opposite of a word,
in four phrasings, a system turn in half of them. A model this small learns it in a few hundred CPU steps.

    python -m app.tools.instructions <folder> [--rows 2000] [--seed 0] [--pairs | --prompts]

Writes <folder>/chats.jsonl and <folder>/model; with --pairs, <folder>/pairs.jsonl instead of the chats: preference
pairs in TRL's conversational form, the opposite chosen and another word of the list rejected
(docs/preference-tuning.md); with --prompts, <folder>/prompts.jsonl (the chats' prompts and each one's `answer`) and
<folder>/rewards.py, an exact-match reward as TRL's documentation writes one, for --task grpo (docs/rl.md). A model that has learnt the pairs answers every held-out row
right; one that guesses is right once in len(OPPOSITES) (docs/instruction-tuning.md, "A worked example").
"""
import argparse
import json
import random
from pathlib import Path

OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("day", "night"), ("old", "new"), ("fast", "slow"),
             ("left", "right"), ("open", "shut"), ("wet", "dry"), ("high", "low"), ("hard", "soft"),
             ("full", "empty"), ("light", "dark"), ("early", "late"), ("rich", "poor"), ("thick", "thin"),
             ("loud", "quiet"), ("sweet", "sour"), ("near", "far"), ("happy", "sad")]
PHRASINGS = ["Opposite of {}?", "What is the opposite of {}?", "Give the opposite of {}.", "{}: opposite?"]
SYSTEM = "You answer with one word."
# Llama's architecture at a size a CPU trains in seconds: 2 layers, width 128, the byte tokenizer's 258 tokens
# padded to 320 rows of embedding.
SHAPE = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=256, vocab_size=320, tie_word_embeddings=False)


def chat(rng: random.Random) -> dict:
    """One conversation: a word in one of the phrasings, its opposite as the answer."""
    word, opposite = rng.choice(OPPOSITES)
    turns = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
    return {"messages": turns + [{"role": "user", "content": rng.choice(PHRASINGS).format(word)},
                                 {"role": "assistant", "content": opposite}]}


def pair(rng: random.Random) -> dict:
    """One preference pair: the prompt of a chat, the opposite chosen, another word of the list rejected."""
    turns = chat(rng)["messages"]
    right = turns[-1]["content"]
    wrong = rng.choice([w for both in OPPOSITES for w in both if w != right])
    return {"prompt": turns[:-1], "chosen": [{"role": "assistant", "content": right}],
            "rejected": [{"role": "assistant", "content": wrong}]}


def prompt(rng: random.Random) -> dict:
    """One prompt for online RL: a chat without its answer, the answer a column the reward reads."""
    turns = chat(rng)["messages"]
    return {"prompt": turns[:-1], "answer": turns[-1]["content"]}


REWARDS = '''"""Rewards for --task grpo, written as TRL's documentation writes them."""


def exact_answer(completions, answer, **kwargs):
    """1.0 where the completion's text is the expected answer, else 0.0."""
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]
'''


def write_prompts(folder: Path, rows: int, seed: int) -> Path:
    """folder/prompts.jsonl with rows prompts, and folder/rewards.py."""
    path = _rows(folder, "prompts.jsonl", prompt, rows, seed)
    (folder / "rewards.py").write_text(REWARDS)
    return path


def _rows(folder: Path, name: str, make, rows: int, seed: int) -> Path:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join(json.dumps(make(rng)) + "\n" for _ in range(rows)))
    return path


def write_pairs(folder: Path, rows: int, seed: int) -> Path:
    """folder/pairs.jsonl with rows preference pairs."""
    return _rows(folder, "pairs.jsonl", pair, rows, seed)


def write(folder: Path, rows: int, seed: int) -> Path:
    """folder/chats.jsonl with rows conversations."""
    return _rows(folder, "chats.jsonl", chat, rows, seed)


def write_model(folder: Path, seed: int, layers: int = SHAPE["num_hidden_layers"]) -> Path:
    """folder/model: a randomly initialised LlamaForCausalLM of SHAPE (with that many layers) and the byte-level
    tokenizer, as save_pretrained writes them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from app.data.tokenizers import byte_tokenizer
    tokenizer = byte_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(**{**SHAPE, "num_hidden_layers": layers}, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return folder / "model"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--pairs", action="store_true", help="preference pairs (pairs.jsonl) instead of chats")
    kind.add_argument("--prompts", action="store_true", help="prompts and a reward (prompts.jsonl, rewards.py) "
                        "for --task grpo instead of chats")
    args = parser.parse_args(argv)
    data = (write_pairs if args.pairs else write_prompts if args.prompts else write)(Path(args.folder), args.rows,
                                                                                     args.seed)
    print(f"wrote {data} and {write_model(Path(args.folder), args.seed)}")


if __name__ == "__main__":
    main()
