"""Answers to look at: at each evaluation of instruction fine-tuning, the model's greedy answers to the first few
held-out prompts, written to <output_dir>/answers/step<N>.jsonl and shown by the main rank.

Every rank generates: under ZeRO-3 each forward gathers the weights from all of them, so they must run the same
forwards in the same order. They do: the same prompts, one batch of them padded on the right to a fixed length
(the causal attention never lets a token see what follows it, and a compiled model meets one shape), and a bounded
number of new tokens; each rank stops when all its prompts have ended, which on identical weights and inputs is
the same step on every rank.
"""
import json
from pathlib import Path

import torch

from app.distributed import dist

FOLDER = "answers"


class Answers:
    """Called with the step after each evaluation; prompts: [(prompt ids, expected answer ids)]."""

    def __init__(self, engine, tokenizer, prompts: list, output_dir: Path, max_new_tokens: int, positions: int,
                 ends: tuple):
        """ends: the tokens that end an answer (the task's end_ids)."""
        self.engine, self.tokenizer, self.prompts, self.folder = engine, tokenizer, prompts, Path(output_dir) / FOLDER
        self.ends = set(ends)
        longest = max(len(p) for p, _ in prompts)
        self.new_tokens = max(0, min(max_new_tokens, positions - longest))

    def generate(self) -> list:
        """The greedy answer ids to each prompt, up to a token that ends it (with it) or new_tokens."""
        pad = self.tokenizer.pad_token_id
        length = max(len(p) for p, _ in self.prompts) + self.new_tokens
        ids = torch.full((len(self.prompts), length), pad, dtype=torch.long)
        ends = [len(p) for p, _ in self.prompts]
        for row, (prompt, _) in enumerate(self.prompts):
            ids[row, :len(prompt)] = torch.tensor(prompt)
        answers, done = [[] for _ in self.prompts], [False] * len(self.prompts)
        was_training = self.engine.module.training
        self.engine.eval()
        with torch.no_grad():
            for _ in range(self.new_tokens):
                logits = self.engine(ids.to(self.engine.device))[..., :len(self.tokenizer)]  # tokens it has
                picked = logits[torch.arange(len(ends)), torch.tensor(ends) - 1].argmax(-1).tolist()
                for row, token in enumerate(picked):
                    if done[row]:
                        continue
                    answers[row].append(token)
                    ids[row, ends[row]] = token
                    ends[row] += 1
                    done[row] = token in self.ends
                if all(done):
                    break
        self.engine.train(was_training)
        return answers

    def __call__(self, step: int):
        answers = self.generate()
        if not dist.is_main():
            return
        text = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        rows = [{"prompt": self.tokenizer.decode(prompt), "expected": text(expected), "answer": text(answer)}
                for (prompt, expected), answer in zip(self.prompts, answers)]
        self.folder.mkdir(exist_ok=True)
        (self.folder / f"step{step:08d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        shown = "; ".join(f"{r['answer'].strip()!r} (expected {r['expected'].strip()!r})" for r in rows[:3])
        dist.print0(f"step {step} answers: {shown}; all in {self.folder / f'step{step:08d}.jsonl'}")


def for_run(engine, task, output_dir: Path, count: int, max_new_tokens: int):
    """The Answers of an instruction or preference run (None for other tasks, when count is 0, and on a pipeline,
    whose stages cannot run the whole model; it says so)."""
    prompts = task.answer_prompts(count) if count else []
    if not prompts:
        return None
    if engine.pipeline_parallelism:
        dist.print0("answers: not generated under pipeline parallelism (no stage holds the whole model)")
        return None
    if engine.sequence_parallel_size > 1:
        dist.print0("answers: not generated under sequence parallelism (each rank holds a part of every sequence)")
        return None
    return Answers(engine, task.tokenizer, prompts, output_dir, max_new_tokens, task.spec.max_positions,
                   task.end_ids())
