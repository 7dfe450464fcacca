"""Reward functions (app/core/rewards.py): the user's own files, called as TRL calls them, and every way one can go
wrong said in one line naming the function and the row."""
import math

import pytest

from app.core import rewards
from app.errors import UserError

TRL_STYLE = '''
import re

def format_reward(completions, **kwargs):
    """As TRL's documentation writes one: completions as text, the other columns in kwargs."""
    return [1.0 if re.match(r"^<think>.*?</think>", c) else 0.0 for c in completions]

def exact(prompts, completions, answer, **kwargs):
    return [None if a is None else float(c.strip() == a) for c, a in zip(completions, answer)]

def chat_length(completions, **kwargs):
    return [-len(c[0]["content"]) for c in completions]

def broken(completions, **kwargs):
    return [1.0 / len(c) for c in completions]

def short(completions, **kwargs):
    return [1.0]

def wordy(completions, **kwargs):
    return ["good" for _ in completions]
'''


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(TRL_STYLE)
    return path


def _score(found, completions, answer=("4", "5", None)):
    names = [f"row {i} (completion 0)" for i in range(len(completions))]
    return rewards.score(found, ["q"] * len(completions), list(completions), [[1]] * len(completions),
                         {"answer": list(answer)[:len(completions)]}, 3, names)


def test_functions_written_as_trls_documentation_writes_them_score_each_completion(source):
    found = rewards.load(f"{source}:format_reward,{source}:exact", "0.5,2")
    assert [(r.name, r.weight) for r in found] == [("format_reward", 0.5), ("exact", 2.0)]
    assert len(found[0].digest) == 64 and found[0].digest == found[1].digest
    scored = _score(found, ["<think>x</think>4", " 5 ", "7"])
    assert scored.shape == (3, 2)
    assert scored[:, 0].tolist() == [1.0, 0.0, 0.0]
    assert scored[:2, 1].tolist() == [0.0, 1.0] and math.isnan(scored[2, 1]), "None: not applicable"


def test_conversational_completions_arrive_as_messages(source):
    found = rewards.load(f"{source}:chat_length", "")
    scored = rewards.score(found, [[{"role": "user", "content": "hi"}]], [[{"role": "assistant", "content": "abc"}]],
                           [[1, 2]], {}, 0, ["row 0 (completion 0)"])
    assert scored.tolist() == [[-3.0]]


@pytest.mark.parametrize("name, message", [
    ("broken", r"reward broken failed on row 1 \(completion 0\): ZeroDivisionError: float division by zero"),
    ("short", r"reward short returned 1 values for the 3 completions of row 0 \(completion 0\) and on"),
    ("wordy", r"reward wordy returned str for row 0 \(completion 0\); return a number or None"),
])
def test_a_function_that_fails_is_one_line_naming_it_and_the_row(source, name, message):
    with pytest.raises(UserError, match=message):
        _score(rewards.load(f"{source}:{name}", ""), ["ab", "", "c"])


def test_mistakes_in_naming_the_functions_are_one_line_each(source, tmp_path):
    (tmp_path / "bad.py").write_text("import no_such_module_here\n")
    (tmp_path / "logs.py").write_text("def f(completions, log_metric, log_extra=None, **kwargs):\n    return []\n")
    cases = [("", "", "--task grpo needs --reward FILE.py:NAME"),
             ("exact", "", "name a function as FILE.py:NAME"),
             (f"{tmp_path}/none.py:f", "", "is not a file"),
             (f"{source}:missing", "", "has no function 'missing'; it has: broken, chat_length, exact"),
             (f"{tmp_path / 'bad.py'}:f", "", "importing .* failed: ModuleNotFoundError"),
             (f"{tmp_path / 'logs.py'}:f", "", "needs log_metric, which TRL gives and the app does not; give it a "
                                               "default of None"),
             (f"{source}:exact", "1,2", "gives 2 weight\\(s\\) for 1 reward function"),
             (f"{source}:exact", "x", "give one number per reward function")]
    for listed, weights, message in cases:
        with pytest.raises(UserError, match=message):
            rewards.load(listed, weights)


def test_two_functions_of_one_name_are_told_apart(source):
    assert [r.name for r in rewards.load(f"{source}:exact,{source}:exact", "")] == ["exact_1", "exact_2"]


MODULE_LIKE = '''
from __future__ import annotations
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from checker_next_to_it import matches


@dataclass
class Verdict:
    score: float


def _judge(text: str) -> float:
    return Verdict(1.0 if matches(text) else 0.0).score


def judged(completions, **kwargs):
    """Checked in worker processes, as code-execution rewards are: the function must pickle by its module's name."""
    with ProcessPoolExecutor(2) as pool:
        return list(pool.map(_judge, completions))
'''


def test_a_reward_file_is_a_module_that_imports_its_neighbours_and_pickles(tmp_path):
    """A file with a dataclass under postponed annotations, a helper module beside it and worker processes:
    each needs the file imported as a module (in sys.modules, its folder importable), as TRL's users import it."""
    (tmp_path / "checker_next_to_it.py").write_text("def matches(text):\n    return text.strip() == '4'\n")
    (tmp_path / "judge.py").write_text(MODULE_LIKE)
    found = rewards.load(f"{tmp_path / 'judge.py'}:judged", "")
    assert _score(found, ["4", " 4 ", "5"])[:, 0].tolist() == [1.0, 1.0, 0.0]


NUMPY_AND_ASYNC = '''
import asyncio
import numpy as np
import torch

def close(completions, answer, **kwargs):
    return [np.isclose(len(c), 1) for c in completions]

def as_array(completions, **kwargs):
    return np.array([len(c) for c in completions], dtype=np.float32)

def as_tensor(completions, **kwargs):
    return torch.tensor([float(len(c)) for c in completions])

async def remote(completions, **kwargs):
    await asyncio.sleep(0.01)
    return [2.0 * len(c) for c in completions]

async def remote_fails(completions, **kwargs):
    return [1.0 / len(c) for c in completions]

def matrix(completions, **kwargs):
    return np.ones((len(completions), 2))
'''


def test_numpy_and_torch_returns_and_async_functions_score_as_trls_tensor_takes_them(tmp_path):
    """TRL builds its rewards with torch.tensor(returned), which takes numpy bools, arrays and tensors, and awaits
    `async def` functions (TRL's documented Example 5)."""
    path = tmp_path / "mixed.py"
    path.write_text(NUMPY_AND_ASYNC)
    found = rewards.load(",".join(f"{path}:{n}" for n in ("close", "as_array", "as_tensor", "remote")), "")
    assert _score(found, ["a", "bb", "ccc"]).tolist() == [[1.0, 1.0, 1.0, 2.0], [0.0, 2.0, 2.0, 4.0],
                                                          [0.0, 3.0, 3.0, 6.0]]
    with pytest.raises(UserError, match=r"reward remote_fails failed on row 1 \(completion 0\): ZeroDivisionError"):
        _score(rewards.load(f"{path}:remote_fails", ""), ["a", "", "c"])
    with pytest.raises(UserError, match=r"reward matrix returned ndarray for the 3 completions"):
        _score(rewards.load(f"{path}:matrix", ""), ["a", "b", "c"])
