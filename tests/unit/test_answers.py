"""The answers at each instruction evaluation: greedy, one shape, bounded, written by rank 0; which runs get them."""
import json
from types import SimpleNamespace

import datasets
import pytest
import torch

from app.data import Data
from app.data import DataInfo
from app.core import answers, tasks
from app.data import chat
from app.data.tokenizers import byte_tokenizer

TOKENIZER = byte_tokenizer()
EOS = TOKENIZER.eos_token_id


def _ids(text: str) -> list:
    return TOKENIZER(text, add_special_tokens=False).input_ids


class _Successor(torch.nn.Module):
    """A causal model whose every position predicts the token `after` gives for its own; its output is wider than
    the tokenizer (a padded vocabulary), with the largest logit always past the tokenizer's last token."""

    def __init__(self, after: dict, width: int = len(TOKENIZER) + 6):
        super().__init__()
        table = torch.zeros(width, width)
        table[:, width - 1] = 10.0
        for token, following in after.items():
            table[token, following] = 5.0
        self.table = torch.nn.Parameter(table)
        self.device, self.pipeline_parallelism, self.shapes = torch.device("cpu"), False, []
        self.sequence_parallel_size = 1

    @property
    def module(self):
        return self

    def forward(self, ids):
        self.shapes.append(tuple(ids.shape))
        return self.table[ids]


def _alphabet_model() -> _Successor:
    """a -> b -> c -> d -> end of text; x -> y -> z -> z -> ... (never ends)."""
    letters = [_ids(c)[0] for c in "abcdxyz"]
    after = dict(zip(letters[:3], letters[1:4])) | {letters[3]: EOS, letters[4]: letters[5], letters[5]: letters[6],
                                                    letters[6]: letters[6]}
    return _Successor(after)


PROMPTS = [(_ids("ab"), _ids("cd")), (_ids("x"), _ids("yz"))]


def test_each_prompt_is_answered_greedily_up_to_its_end_of_text_or_the_budget(tmp_path):
    engine = _alphabet_model()
    said = answers.Answers(engine, TOKENIZER, PROMPTS, tmp_path, max_new_tokens=4, positions=64,
                           ends=(EOS,)).generate()
    assert said == [_ids("cd") + [EOS], _ids("yzzz")], "no token past the tokenizer's, none after the end"
    assert engine.shapes == [(2, 6)] * 4, "every forward has one shape: a compiled model meets one graph"


def test_an_answer_ends_at_any_of_the_models_end_tokens(tmp_path):
    """Gemma's chat template ends a turn with <end_of_turn>, and its generation_config.json lists it beside the
    tokenizer's <eos>: an answer stops there, not at the budget."""
    turn_end = _ids("!")[0]
    letters = [_ids(c)[0] for c in "abcd"]
    engine = _Successor(dict(zip(letters[:3], letters[1:4])) | {letters[3]: turn_end, turn_end: letters[0]})
    said = answers.Answers(engine, TOKENIZER, PROMPTS[:1], tmp_path, max_new_tokens=10, positions=64,
                           ends=(EOS, turn_end)).generate()
    assert said == [_ids("cd!")]
    task = tasks.Instruction.__new__(tasks.Instruction)
    task.tokenizer = TOKENIZER
    task.generation = SimpleNamespace(eos_token_id=[turn_end, EOS])
    assert task.end_ids() == tuple(sorted({EOS, turn_end}))
    task.generation = SimpleNamespace(eos_token_id=EOS)
    assert task.end_ids() == (EOS,)


def test_generation_stops_once_every_prompt_has_ended(tmp_path):
    engine = _alphabet_model()
    said = answers.Answers(engine, TOKENIZER, PROMPTS[:1], tmp_path, max_new_tokens=50, positions=64,
                           ends=(EOS,)).generate()
    assert said == [_ids("cd") + [EOS]] and len(engine.shapes) == 3


@pytest.mark.parametrize("positions, new_tokens", [(5, 3), (2, 0), (1, 0)])
def test_the_answers_never_run_past_the_models_positions(positions, new_tokens, tmp_path):
    engine = _alphabet_model()
    made = answers.Answers(engine, TOKENIZER, PROMPTS, tmp_path, max_new_tokens=4, positions=positions, ends=(EOS,))
    assert made.new_tokens == new_tokens
    said = made.generate()
    assert [len(a) for a in said] == [min(new_tokens, 3), new_tokens]
    assert all(shape[1] <= max(positions, 2) for shape in engine.shapes)


@pytest.mark.parametrize("training", [True, False])
def test_the_model_is_left_in_the_mode_it_was_in(training, tmp_path):
    engine = _alphabet_model().train(training)
    answers.Answers(engine, TOKENIZER, PROMPTS, tmp_path, max_new_tokens=2, positions=64, ends=(EOS,)).generate()
    assert engine.training is training and engine.table.grad is None


def test_the_answers_are_written_for_the_step_and_the_first_three_shown(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    prompts = PROMPTS + [(_ids("c"), _ids("d")), (_ids("y"), _ids("z"))]
    answers.Answers(_alphabet_model(), TOKENIZER, prompts, tmp_path, max_new_tokens=4, positions=64,
                    ends=(EOS,))(10)
    written = tmp_path / answers.FOLDER / "step00000010.jsonl"
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert [(r["prompt"], r["expected"], r["answer"]) for r in rows] == [
        ("ab", "cd", "cd"), ("x", "yz", "yzzz"), ("c", "d", "d"), ("y", "z", "zzzz")]
    assert capsys.readouterr().out == (f"step 10 answers: 'cd' (expected 'cd'); 'yzzz' (expected 'yz'); 'd' "
                                       f"(expected 'd'); all in {written}\n")


def test_a_rank_other_than_the_main_one_generates_but_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    engine = _alphabet_model()
    answers.Answers(engine, TOKENIZER, PROMPTS, tmp_path, max_new_tokens=4, positions=64, ends=(EOS,))(10)
    assert len(engine.shapes) == 4, "it runs the same forwards: under ZeRO-3 they gather weights together"
    assert not (tmp_path / answers.FOLDER).exists() and capsys.readouterr().out == ""


def _rows() -> chat.AnswerRows:
    """Three held-out rows as app/data/chat.py makes them: prompt tokens, then the answer [start, end)."""
    ids = [_ids("ab") + _ids("cd") + [EOS], _ids("x") + _ids("yz") + [EOS], _ids("c") + _ids("d") + [EOS]]
    answer = [[2, 5], [1, 4], [1, 3]]
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids, "answer": answer, "units": [3, 3, 2]})
    return chat.AnswerRows(data, TOKENIZER.pad_token_id, 8)


def _task(name="instruction", eval_set=None, max_positions=16):
    held = eval_set if eval_set is not None else _rows()
    kind = tasks.Instruction if name == "instruction" else tasks.CausalLM
    return kind(None, SimpleNamespace(max_positions=max_positions),
                Data(held, held, DataInfo(0, task="causal_lm", seq_len=8)), TOKENIZER)


def test_an_instruction_run_answers_its_first_held_out_prompts_counted_in_rows_even_packed(tmp_path):
    made = answers.for_run(_alphabet_model(), _task(), tmp_path, count=2, max_new_tokens=30)
    assert made.prompts == [(_ids("ab"), _ids("cd") + [EOS]), (_ids("x"), _ids("yz") + [EOS])]
    assert made.new_tokens == 16 - 2, "bounded by the model's positions"
    packed = chat.PackedRows(_rows(), 8)
    assert len(packed) < 3
    made = answers.for_run(_alphabet_model(), _task(eval_set=packed), tmp_path, count=10, max_new_tokens=4)
    assert len(made.prompts) == 3 and made.prompts[2] == (_ids("c"), _ids("d") + [EOS])


def test_other_runs_get_no_answers_and_a_pipeline_says_why(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert answers.for_run(_alphabet_model(), _task(), tmp_path, count=0, max_new_tokens=4) is None
    assert answers.for_run(_alphabet_model(), _task("causal_lm"), tmp_path, count=3, max_new_tokens=4) is None
    assert answers.for_run(_alphabet_model(), tasks.ImageClassification(None), tmp_path, 3, 4) is None
    assert capsys.readouterr().out == ""
    staged = _alphabet_model()
    staged.pipeline_parallelism = True
    assert answers.for_run(staged, _task(), tmp_path, count=3, max_new_tokens=4) is None
    assert capsys.readouterr().out == "answers: not generated under pipeline parallelism (no stage holds the whole " \
                                      "model)\n"
