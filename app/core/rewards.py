"""Reward functions of online RL: the user's own Python files, named on the command line (--reward FILE.py:NAME),
imported as modules (a file imports its neighbours) and called as TRL's GRPOTrainer calls them, `async def` ones
awaited together. Nothing is ever imported from a checkpoint or a dataset."""
import asyncio
import hashlib
import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from app.errors import UserError, first_line


@dataclass(frozen=True)
class Reward:
    """One reward function: its name in the metrics (rewards/<name>/mean), its weight in the sum, and the sha256 of
    its file, which a checkpoint records."""
    name: str
    fn: object
    weight: float
    digest: str


@dataclass
class Asked:
    """What the reward functions are given beside each completion: its prompt, the dataset's other columns of its
    row, and its name in their messages."""
    prompts: list
    columns: dict
    names: list

    def rows(self, picked: list) -> "Asked":
        """The same of the completions picked (their indices)."""
        return Asked([self.prompts[i] for i in picked], {k: [v[i] for i in picked] for k, v in self.columns.items()},
                     [self.names[i] for i in picked])


def _load_one(item: str, index: int):
    path, _, name = item.rpartition(":")
    if not path or not name:
        raise UserError(f"--reward {item!r}: name a function as FILE.py:NAME (for example rewards.py:exact_match)")
    if not Path(path).is_file():
        raise UserError(f"--reward {item!r}: {path} is not a file")
    spec = importlib.util.spec_from_file_location(f"app_reward_{index}_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    folder = str(Path(path).resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)  # as `python FILE.py` would, after what is installed: a file's own helpers import
    sys.modules[spec.name] = module  # a module like any other: dataclasses and pickle look it up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 (the user's code: its error, in one line)
        del sys.modules[spec.name]
        raise UserError(f"--reward {item!r}: importing {path} failed: {type(e).__name__}: {first_line(e)}") from None
    fn = vars(module).get(name)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise UserError(f"--reward {item!r}: {path} has no function {name!r}; it has: {', '.join(found) or 'none'}")
    _refuse_what_is_not_given(fn, item)
    return fn, hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _refuse_what_is_not_given(fn, item: str):
    """TRL also gives its log_extra and log_metric callables (and environments, with its environment_factory),
    which the app does not: a function that needs one is refused before the run, not at its first step."""
    try:
        needed = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):  # a callable without a signature: its call says what it lacks
        return
    missing = [name for name in ("log_extra", "log_metric", "environments") if name in needed]
    if missing:
        raise UserError(f"--reward {item!r} needs {missing[0]}, which TRL gives and the app does not; give it a "
                        f"default of None and skip it where it is None, as TRL's own example does (docs/rl.md)")


def require(listed: str):
    """Refuse a run without reward functions, before its data is read."""
    if not listed:
        raise UserError("--task grpo needs --reward FILE.py:NAME[,FILE.py:NAME...]: the functions that score each "
                        "completion (docs/rl.md, \"Reward functions\")")


def load(listed: str, weights: str) -> list:
    """The Rewards of --reward and --reward_weights."""
    require(listed)
    items = [item.strip() for item in listed.split(",")]
    try:
        numbers_given = [float(w) for w in weights.split(",")] if weights else [1.0] * len(items)
    except ValueError:
        raise UserError(f"--reward_weights {weights!r}: give one number per reward function, comma-separated") \
            from None
    if len(numbers_given) != len(items):
        raise UserError(f"--reward_weights gives {len(numbers_given)} weight(s) for {len(items)} reward function(s); "
                        f"give one each, in order")
    loaded = [_load_one(item, i) for i, item in enumerate(items)]
    names = [getattr(fn, "__name__", type(fn).__name__) for fn, _ in loaded]
    names = [f"{n}_{names[:i].count(n) + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)]
    return [Reward(n, fn, w, digest) for n, (fn, digest), w in zip(names, loaded, numbers_given)]


def _value(value, reward: Reward, row: str) -> float:
    """A function's number for one completion as TRL's torch.tensor takes it (a Python or numpy number or bool, a
    one-element tensor); None: not applicable to it (TRL's rule)."""
    if value is None:
        return math.nan
    if not isinstance(value, (str, bytes)) and hasattr(type(value), "__float__"):
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):  # a tensor of several numbers
            pass
    raise UserError(f"reward {reward.name} returned {type(value).__name__} for {row}; return a number or None "
                    f"for each completion")


def _values(reward: Reward, values, count: int, rows: list) -> list:
    """The function's numbers, one per completion: a list or tuple, or a one-dimensional array or tensor."""
    if getattr(values, "ndim", None) == 1 and hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != count:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise UserError(f"reward {reward.name} returned {got} for the {count} completions of {rows[0]} "
                        f"and on; return a list with one number (or None) per completion")
    return [_value(v, reward, row) for v, row in zip(values, rows)]


async def _awaited(pending: list) -> list:
    return await asyncio.gather(*pending, return_exceptions=True)


def _returns(rewards: list, kwargs: dict) -> list:
    """Each function's return (or the exception it raised) for kwargs: the plain ones called in turn, then the
    `async def` ones awaited together, as TRL awaits them."""
    returns, pending = [], {}
    for i, reward in enumerate(rewards):
        try:
            returns.append(reward.fn(**kwargs))
        except Exception as e:  # noqa: BLE001 (the user's code: said in one line by score)
            returns.append(e)
        if inspect.isawaitable(returns[-1]):
            pending[i] = returns[-1]
    for i, result in zip(pending, asyncio.run(_awaited(list(pending.values()))) if pending else []):
        returns[i] = result
    return returns


def _failing_row(reward: Reward, kwargs: dict, rows: list) -> str:
    """The first row whose completion alone makes the function raise (else all of them together)."""
    for i, row in enumerate(rows):
        alone = {k: v if k == "trainer_state" else v[i:i + 1] for k, v in kwargs.items()}
        if isinstance(_returns([reward], alone)[0], BaseException):
            return row
    return f"{rows[0]} and the rows after it, together"


def score(rewards: list, prompts: list, completions: list, completion_ids: list, columns: dict, step: int,
          rows: list) -> torch.Tensor:
    """(completions, functions) float64 rewards, NaN where a function said None; rows: each completion's name for
    an error line (its row of the data and its number in the group)."""
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
              "trainer_state": SimpleNamespace(global_step=step), **columns}
    found = []
    for reward, returned in zip(rewards, _returns(rewards, kwargs)):
        if isinstance(returned, BaseException):
            raise UserError(f"reward {reward.name} failed on {_failing_row(reward, kwargs, rows)}: "
                            f"{type(returned).__name__}: {first_line(returned)}") from None
        found.append(_values(reward, returned, len(completions), rows))
    return torch.tensor(found, dtype=torch.float64).T.reshape(len(completions), len(rewards))
