"""Reward functions of online RL: the user's own Python files, named on the command line (--reward FILE.py:NAME),
called as TRL's GRPOTrainer calls them. Nothing is ever imported from a checkpoint or a dataset."""
import hashlib
import importlib.util
import math
import numbers
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
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 (the user's code: its error, in one line)
        raise UserError(f"--reward {item!r}: importing {path} failed: {type(e).__name__}: {first_line(e)}") from None
    fn = vars(module).get(name)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise UserError(f"--reward {item!r}: {path} has no function {name!r}; it has: {', '.join(found) or 'none'}")
    return fn, hashlib.sha256(Path(path).read_bytes()).hexdigest()


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
    if value is None:
        return math.nan  # not applicable to this completion (TRL's rule)
    if isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return float(value)
    raise UserError(f"reward {reward.name} returned {type(value).__name__} for {row}; return a number or None "
                    f"for each completion")


def _called(reward: Reward, prompts, completions, completion_ids, columns: dict, state, rows: list) -> list:
    try:
        values = reward.fn(prompts=prompts, completions=completions, completion_ids=completion_ids,
                           trainer_state=state, **columns)
    except Exception as e:  # noqa: BLE001 (the user's code: which row it failed on, in one line)
        where = _failing_row(reward, prompts, completions, completion_ids, columns, state, rows)
        raise UserError(f"reward {reward.name} failed on {where}: {type(e).__name__}: {first_line(e)}") from None
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise UserError(f"reward {reward.name} returned {got} for the {len(completions)} completions of {rows[0]} "
                        f"and on; return a list with one number (or None) per completion")
    return [_value(v, reward, row) for v, row in zip(values, rows)]


def _failing_row(reward: Reward, prompts, completions, completion_ids, columns: dict, state, rows: list) -> str:
    """The first row whose completion alone makes the function raise (else all of them together)."""
    for i, row in enumerate(rows):
        try:
            reward.fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1], trainer_state=state,
                      completion_ids=completion_ids[i:i + 1], **{k: v[i:i + 1] for k, v in columns.items()})
        except Exception:  # noqa: BLE001 (found: this row)
            return row
    return f"{rows[0]} and the rows after it, together"


def score(rewards: list, prompts: list, completions: list, completion_ids: list, columns: dict, step: int,
          rows: list) -> torch.Tensor:
    """(completions, functions) float64 rewards, NaN where a function said None; rows: each completion's name for
    an error line (its row of the data and its number in the group)."""
    state = SimpleNamespace(global_step=step)
    found = [_called(r, prompts, completions, completion_ids, columns, state, rows) for r in rewards]
    return torch.tensor(found, dtype=torch.float64).T.reshape(len(completions), len(rewards))
