"""The GRPO step: the optimizer step's prompts gathered micro batch by micro batch, then, at its last, their
completions sampled (app/core/rollout.py), scored (app/core/rewards.py) and their window's totals summed over every
rank once, before any backward; then each micro batch's forward, backward and engine step in DeepSpeed's order.

dapo's loss divides by the completion tokens of the whole step on every rank, and --scale_rewards batch by the
step's reward std: neither is known before the step's last completion is sampled, so the step samples them all
first (TRL's generation batch is the step's window too)."""
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from app.checkpoint.save import atomic_write
from app.core import grpo_kept, grpo_loss, rewards, rollout
from app.core.rewards import Asked
from app.core.step import TrainStep
from app.distributed import dist
from app.ds import internals as ds_internals
from app.observe.metrics import Meter


@dataclass
class Part:
    """One micro batch of the window, its completions sampled: rows x group sequences."""
    ids: torch.Tensor
    """(n, prompt + completion) each sequence's prompt, then its completion, right-padded."""
    starts: torch.Tensor
    completions: torch.Tensor
    mask: torch.Tensor
    share: torch.Tensor
    """Each completion's weight: its prompt's loader weight over the group size (0: padding)."""
    rewards: torch.Tensor
    truncated: torch.Tensor
    length: torch.Tensor
    """Each completion's tokens, up to and with its end (whether or not the loss masks it)."""
    advantages: torch.Tensor = None
    old: torch.Tensor = None
    """(n, max_new) the completions' log-probabilities under the policy that sampled them, where a cycle of
    --num_iterations steps trains on them again (None: the step's own, detached; the ratio is 1)."""
    rows: list = None
    """Each completion's prompt: its row in the set, and its text (for --log_completions)."""
    texts: list = None


def sequences(prompts: torch.Tensor, lengths: torch.Tensor, completions: torch.Tensor, pad: int) -> torch.Tensor:
    """(n, P + L): each prompt's own tokens (left-padded in prompts), then its completion, right-padded."""
    width = prompts.shape[1]
    out = torch.full((len(prompts), width + completions.shape[1]), pad, dtype=torch.long)
    for r, (prompt, n) in enumerate(zip(prompts, lengths.tolist())):
        out[r, :n] = prompt[width - n:]
        out[r, n:n + completions.shape[1]] = completions[r]
    return out


def part_of(batch, group: int, pad: int, texts: list, **fields) -> Part:
    """The Part of a micro batch of prompts (ids, [rows, prompt lengths], loader weights), each `group` times, with
    its completions' fields (sampled, or kept by a cycle: app/core/grpo_kept.py)."""
    x, y, w = batch
    lengths = y[:, 1].repeat_interleave(group)
    return Part(sequences(x.repeat_interleave(group, 0), lengths, fields["completions"], pad), lengths,
                share=w.repeat_interleave(group) / group, texts=texts,
                rows=[r for r in y[:, 0].tolist() for _ in range(group)], **fields)


class GrpoStep(TrainStep):
    """A micro step of online RL (the task: app/core/grpo.py)."""

    def __init__(self, engine, task, compile_model: bool, board=None):
        super().__init__(engine, task, False, board)  # completions are sampled inside the step: eager
        self.metrics, self.window = task.metrics, []
        self.reference = task.live_reference(engine)
        self.gather = task.gathering(engine)
        self.replicas = dist.world_size()  # DeepSpeed's mean over them gives the step's gradient
        self.counts = True  # whether this rank's completions count in the step's totals

    def micro_step(self, batch, meter: Meter):
        """Gather the window's micro batches; at its last, sample, then train on each in turn."""
        self.window.append(batch)
        if len(self.window) < self.engine.gradient_accumulation_steps():
            return
        window, self.window = self.window, []
        started = time.perf_counter()
        parts, totals = self.cycle_parts(window)  # its last act reads the host: the device has finished
        totals["sampling_s"] = time.perf_counter() - started
        if self.task.settings.log_completions:
            write_completions(self.task.output_dir, self.engine.global_steps + 1, parts if self.counts else [],
                              self.task)
        for part in parts:
            loss, sums, weight = self.part_loss(part, totals)
            self.engine.backward(loss)
            self.engine.step()
            meter.add(self.meter_weights((part.share > 0).sum() / self.task.group), weight, **sums)

    def trial_parts(self, batch) -> list:
        """The micro batch search's step: sampling and the forward, then the backward and the engine step."""
        held = {}

        def forward():
            parts, totals = self.rolled_out([batch])
            held["loss"] = self.part_loss(parts[0], totals)[0]
        return [forward, lambda: (self.engine.backward(held.pop("loss")), self.engine.step())]

    def sampled(self, batch, how: rollout.Sampling, held, group: int) -> Part:
        """One micro batch's prompts (rows of the set held), each sampled group times, scored."""
        task = self.task
        x, y, w = batch
        rows, lengths = y[:, 0].tolist(), y[:, 1].repeat_interleave(group)
        u = rollout.draws(task.settings.seed, self.engine.global_steps, rows, group, how.max_new)
        asked = Asked([p for p in held.prompts(rows) for _ in range(group)],
                      {k: [v for v in values for _ in range(group)] for k, values in held.columns(rows).items()},
                      [f"row {r} (completion {j})" for r in rows for j in range(group)])
        completions, mask, truncated, scored, texts = self.roll(x.repeat_interleave(group, 0), lengths, u, how, asked)
        length = mask.sum(1)
        if task.mask_truncated:
            mask = mask & ~truncated[:, None]
        return part_of(batch, group, task.tokenizer.pad_token_id, texts, completions=completions, mask=mask.float(),
                       rewards=scored, truncated=truncated, length=length)

    def roll(self, prompts: torch.Tensor, lengths: torch.Tensor, u: torch.Tensor, how: rollout.Sampling,
             asked: Asked) -> tuple:
        """(completions, mask, truncated, rewards, texts) of the prompts (rows, left-padded) with their draws u."""
        completions, mask, truncated = self.sample(prompts, lengths, u, how)
        return (completions, mask, truncated, *self.scored(completions, mask, asked))

    def sample(self, prompts: torch.Tensor, lengths: torch.Tensor, u: torch.Tensor, how: rollout.Sampling) -> tuple:
        """(completions, mask, truncated) of the prompts with their draws u (app/core/rollout.py)."""
        tokenizer = self.task.tokenizer
        return rollout.sample(self.engine, prompts, lengths, u, how, len(tokenizer), self.task.end_ids(),
                              tokenizer.pad_token_id, self.task.synced(self.engine), self.gather)

    def scored(self, completions: torch.Tensor, mask: torch.Tensor, asked: Asked) -> tuple:
        """(rewards, texts) of the completions, by the task's functions (app/core/rewards.py)."""
        kept, texts = self.decoded(completions, mask)
        said = [[{"role": "assistant", "content": t}] for t in texts] if isinstance(asked.prompts[0], list) else texts
        return rewards.score(self.task.rewards, asked.prompts, said, kept, asked.columns, self.engine.global_steps,
                             asked.names), texts

    def decoded(self, completions: torch.Tensor, mask: torch.Tensor) -> tuple:
        """(each completion's token ids up to and with its end, its text)."""
        kept = [c[m].tolist() for c, m in zip(completions, mask)]
        return kept, self.task.tokenizer.batch_decode(kept, skip_special_tokens=True)

    def cycle_parts(self, window: list) -> tuple:
        """(Parts, totals) of the window: sampled at the first step of each cycle of --num_iterations, which keeps
        them (app/core/grpo_kept.py); the cycle's later steps train on what it kept, for the loader gives their
        windows again."""
        task, repeats = self.task, self.task.settings.num_iterations
        if self.engine.global_steps % repeats == 0:
            parts, totals = self.rolled_out(window)
            task.kept = grpo_kept.Kept.of(parts, totals, task.group) if repeats > 1 else None
            return parts, totals
        pad = task.tokenizer.pad_token_id
        again = lambda batch, fields, texts: part_of(batch, task.group, pad, texts, **fields)  # noqa: E731
        return task.kept.parts(window, task.group, again), dict(task.kept.totals)

    def rolled_out(self, window: list) -> tuple:
        """The window's Parts, their advantages set, and its totals over every rank."""
        task = self.task
        parts = [self.sampled(batch, task.how, task.data.train, task.group) for batch in window]
        totals = window_totals(parts, task.group, task.rewards, self.counts)
        for part in parts:
            reward = grpo_loss.combined(part.rewards, [r.weight for r in task.rewards])
            part.advantages = grpo_loss.advantages(reward, task.group, task.settings.scale_rewards,
                                                   totals["batch_std"])
            if task.settings.num_iterations > 1:  # the policy that sampled: the ratio's base through the cycle
                with torch.no_grad():
                    within = lambda *inputs: ds_internals.forward_within_the_step(self.engine, *inputs)  # noqa: E731
                    part.old = self.every_logp(self.on_device(part), within).cpu()
        return parts, totals

    def on_device(self, part: Part) -> tuple:
        """(sequences, completions, prompt lengths) of the Part on the engine's device."""
        device = self.engine.device
        return part.ids.to(device), part.completions.to(device), part.starts.to(device)

    def log_probs(self, on_device: tuple, logits) -> torch.Tensor:
        """(n, max_new) the completions' log-probabilities under logits(sequences); on_device: on_device(part)."""
        ids, completions, starts = on_device
        return grpo_loss.token_logps(logits(ids), completions, starts, self.task.how.temperature)

    def every_logp(self, on_device: tuple, logits) -> torch.Tensor:
        """(n, max_new) every completion token's log-probability, whichever rank's slice predicts it (kept by a
        cycle of --num_iterations, which a resume on any layout reads)."""
        return self.log_probs(on_device, logits)

    def my_tokens(self, on_device: tuple, logp: torch.Tensor, old: torch.Tensor, reference) -> tuple:
        """(old, reference, taken): what the ratio and the KL term compare logp with, and which completion tokens'
        losses this rank takes (1.0: all of them)."""
        return old, reference, 1.0

    def part_loss(self, part: Part, totals: dict) -> tuple:
        """(the micro batch's loss, its sums for the meter, its weight): app/core/grpo_loss.py's normalisation."""
        task, device = self.task, self.engine.device
        mask, share, on_device = part.mask.to(device), part.share.to(device), self.on_device(part)
        logp = self.log_probs(on_device, self.engine)
        reference = self.log_probs(on_device, self.reference.logits) if task.beta else None
        old = logp.detach() if part.old is None else part.old.to(device)
        old, reference, taken = self.my_tokens(on_device, logp, old, reference)
        losses, kl, below, above = grpo_loss.token_losses(logp, old, part.advantages.to(device).float(),
                                                          task.epsilon, task.epsilon_high, task.beta, reference)
        scale = self.replicas * self.engine.gradient_accumulation_steps()
        per_token = scale / max(totals["tokens"], 1.0)
        loss = grpo_loss.normalised(task.loss_kind, losses * taken, mask, share, per_token, task.how.max_new)
        whole = self.meter_weights  # what every rank holding the completions holds whole: counted once
        weight = whole(share.sum())  # the prompts' loader weights: share is each one's over its group
        real = (share > 0).float()[:, None]
        token_mean = lambda x: (x * mask * taken * real).sum() * per_token  # noqa: E731
        sums = {"loss": loss.detach(), **{k: v * weight for k, v in totals["shown"].items()},
                "completions/mean_length": whole((share * part.length.to(device)).sum()),
                "completions/clipped_ratio": whole((share * part.truncated.to(device).float()).sum()),
                "clip_ratio/low_mean": token_mean(below), "clip_ratio/high_mean": token_mean(above),
                "clip_ratio/region_mean": token_mean(((below + above) > 0).float())}
        if kl is not None:
            sums["kl"] = token_mean(kl.detach())
        sums["sampling_s"] = weight * totals.get("sampling_s", 0.0)  # the window's: a rank's mean over its steps
        return loss, {name: sums[name] for name in self.metrics}, weight

    def evaluate(self, loader) -> dict:
        """The held-out prompts' completions (one each, greedy or sampled: --eval_sampling), their mean reward and
        length over every rank."""
        task, engine = self.task, self.engine
        how = task.how if task.settings.eval_sampling == "sampled" else rollout.Sampling(0.0, 0, 1.0, task.how.max_new)
        names = ["reward", "completions/mean_length", *(f"rewards/{r.name}/mean" for r in task.rewards)]
        meter = Meter(names, engine.device)
        for batch in loader:
            part = self.sampled(batch, how, task.data.held_out, 1)
            w = part.share.double()
            found = torch.nan_to_num(part.rewards, nan=0.0)  # evaluation: a None counts 0
            reward = grpo_loss.combined(found, [r.weight for r in task.rewards])
            sums = {"reward": (reward * w).sum(), "completions/mean_length": (part.length * w).sum(),
                    **{f"rewards/{r.name}/mean": (found[:, i] * w).sum() for i, r in enumerate(task.rewards)}}
            meter.add(*map(self.meter_weights, ((w > 0).sum(), w.sum())),
                      **{k: self.meter_weights(v.to(engine.device)) for k, v in sums.items()})
        result = meter.reduce()
        return {f"eval_{name}": result[name] for name in names}


def window_totals(parts: list, group: int, functions: list, counts: bool = True) -> dict:
    """What the window's loss and metrics need from every rank, in one host sum: its completion tokens, the reward
    sums for the step's std and the means shown (reward, reward_std: that std, as TRL logs it since 0.27,
    frac_reward_zero_std, rewards/<f>/mean);
    counts: whether this rank's parts count (not where another rank holds the same)."""
    real = [(p.share > 0) for p in parts]
    reward = [grpo_loss.combined(p.rewards, [f.weight for f in functions]) for p in parts]
    local = [sum(float((p.mask.sum(1) * r).sum()) for p, r in zip(parts, real))]
    scored = [torch.where(r & ~x.isnan(), x, 0.0) for r, x in zip(real, reward)]
    counted = sum(float((r & ~x.isnan()).sum()) for r, x in zip(real, reward))
    local += [counted, sum(float(s.sum()) for s in scored), sum(float((s ** 2).sum()) for s in scored)]
    stds = [grpo_loss.group_stats(x, group)[1] for x in reward]
    groups = [r.view(-1, group)[:, 0] for r in real]
    local += [sum(float((s[g] < 1e-8).sum()) for s, g in zip(stds, groups)),  # NaN: no std, not a zero one
              sum(float(g.sum()) for g in groups)]
    for f in range(len(functions)):
        values = [(p.rewards[:, f], r) for p, r in zip(parts, real)]
        local += [sum(float(torch.nansum(torch.where(r, v, 0.0))) for v, r in values),
                  sum(float((r & ~v.isnan()).sum()) for v, r in values)]
    local = local if counts else [0.0] * len(local)
    tokens, n, total, square, zero, count, *per_function = dist.host_sum(local)
    batch_std = max(0.0, (square - total ** 2 / n) / (n - 1)) ** 0.5 if n > 1 else float("nan")
    shown = {"reward": total / max(n, 1), "reward_std": batch_std, "frac_reward_zero_std": zero / max(count, 1),
             **{f"rewards/{f.name}/mean": per_function[2 * i] / max(per_function[2 * i + 1], 1)
                for i, f in enumerate(functions)}}
    return {"tokens": tokens, "shown": shown, "batch_std": batch_std}


def write_completions(output_dir: Path, step: int, parts: list, task):
    """Every rank's completions of optimizer step `step`, gathered into output_dir/completions/step<N>.jsonl by the
    main rank, a line each (by row, then number in the group): its prompt's token ids, its own up to and with its
    end, its text, each function's reward (null: not applicable), the advantage and whether it was cut at
    --max_completion_length."""
    names, mine = [r.name for r in task.rewards], []
    for part in parts:
        for k, (row, text) in enumerate(zip(part.rows, part.texts)):
            if part.share[k] > 0:  # not a rank's padding
                prompt = part.ids[k, :int(part.starts[k])].tolist()
                mine.append({"step": step, "row": row, "completion": k % task.group, "prompt_ids": prompt,
                             "text": text, "ids": part.completions[k, :int(part.length[k])].tolist(),
                             "rewards": {n: None if math.isnan(v) else v
                                         for n, v in zip(names, part.rewards[k].tolist())},
                             "advantage": float(part.advantages[k]), "truncated": bool(part.truncated[k])})
    every = sorted((line for lines in dist.gather_objects(mine) for line in lines),
                   key=lambda line: (line["row"], line["completion"]))
    if dist.is_main():
        folder = output_dir / "completions"
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / f"step{step:08d}.jsonl", "".join(json.dumps(line) + "\n" for line in every))
