"""Preference tuning: the DPO family's losses over pairs of answers, the reference model's log-probabilities of
them, and the step that trains on both.

The reference is the model as training found it: under LoRA the policy itself with its adapters switched off (no
second model), else a frozen copy built as the policy is (partitioned under ZeRO-3, by DeepSpeed without an
optimizer), or, with --reference precompute, one pass over the data before training whose results are kept beside
the tokenized data, keyed by the data and the base model (app/core/reference.py). SimPO needs none.
"""
import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from app.core import lora, models, reference
from app.core.step import TrainStep
from app.core.fused_loss import target_logps
from app.core.reference import AgainstReference, Reference, answer_logps, counted_at_least_one
from app.core.sequence_step import Group, Sliced
from app.core.tasks import answer_prompts, without_dropout
from app.distributed import dist
from app.ds.precision import compute_dtype
from app.errors import UserError
from app.observe.metrics import Meter
from app.settings import Settings

LOSSES = ("sigmoid", "ipo", "hinge", "simpo")
METRICS = ["loss", "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy"]


def pair_losses(kind: str, beta: float, gamma: float, policy: torch.Tensor, reference: torch.Tensor) -> tuple:
    """(loss, chosen's reward, rejected's reward) of each pair. policy: (pairs, 2, 2), the chosen and rejected
    answers' (log-probability, tokens); reference: (pairs, 2), the reference's log-probabilities.

    sigmoid (DPO): -log sigmoid(beta * d), d the chosen answer's log-ratio to the reference minus the rejected one's;
    hinge: max(0, 1 - beta * d); ipo: (d' - 1 / (2 beta))^2, d' of log-ratios averaged over each answer's tokens;
    simpo: -log sigmoid(beta * (mean log-probability of chosen - of rejected) - gamma), no reference. A reward is
    beta times an answer's log-ratio to the reference, summed over its tokens (SimPO: beta times its mean
    log-probability), as TRL logs them."""
    logp, tokens = policy[..., 0], policy[..., 1]
    if kind == "simpo":
        rewards = beta * logp / tokens
        return -F.logsigmoid(rewards[:, 0] - rewards[:, 1] - gamma), rewards[:, 0], rewards[:, 1]
    rewards = beta * (logp - reference)
    if kind == "ipo":
        ratios = (logp - reference) / tokens
        loss = (ratios[:, 0] - ratios[:, 1] - 1 / (2 * beta)) ** 2
    elif kind == "hinge":
        loss = torch.relu(1 - (rewards[:, 0] - rewards[:, 1]))
    else:
        loss = -F.logsigmoid(rewards[:, 0] - rewards[:, 1])
    return loss, rewards[:, 0], rewards[:, 1]


class PreferenceStep(TrainStep):
    """A micro step on pairs: the two answers of each pair through the policy in one forward, the reference's
    log-probabilities (live, or read from the batch once precomputed), the loss weighted so the step's loss is the
    mean over its pairs however they split; the rewards summed beside it."""
    metrics = METRICS

    group = None
    """The sequence-parallel Group whose ranks each hold a slice of the pairs (SequencePairStep), or None."""

    def __init__(self, engine, task, compile_model: bool, board=None):
        super().__init__(engine, task, compile_model, board)
        self.reference = task.live_reference(engine, self.group)

    def batch_loss(self, batch) -> tuple:
        """(the micro batch's weighted loss, its sums for the meter, its weights)."""
        x, (labels, given), w = batch
        device = self.engine.device
        ids = x.to(device, non_blocking=True).flatten(0, 1)  # (pairs x 2, length): chosen, rejected, chosen, ...
        labels = labels.to(device, non_blocking=True).flatten(0, 1)
        w = w.to(device, non_blocking=True)
        reference = self.reference(ids, labels).view(-1, 2) if self.reference is not None else \
            given.to(device, non_blocking=True)
        policy = self.answer_logps(ids, labels)
        task = self.task
        losses, chosen, rejected = pair_losses(task.loss_kind, task.beta, task.gamma, policy.view(-1, 2, 2),
                                               reference)
        sums = {"loss": (losses.detach() * w).sum(), "rewards_chosen": (chosen.detach() * w).sum(),
                "rewards_rejected": (rejected.detach() * w).sum(),
                "reward_margin": ((chosen - rejected).detach() * w).sum(),
                "reward_accuracy": ((chosen > rejected).float() * w).sum()}
        return (losses * w).sum(), sums, w

    def answer_logps(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(sequences, 2): the policy's log-probability of each sequence's answer and its token count."""
        return self.logits_and_losses(self.with_targets([ids], labels), labels)[1]

    def evaluate(self, loader) -> dict:
        """The held-out pairs' loss and rewards over every rank's shard, padding excluded: means over pairs."""
        engine = self.engine
        meter = Meter(self.metrics, engine.device)
        engine.eval()
        with torch.no_grad():
            for batch in loader:
                _, sums, w = self.batch_loss(batch)
                w = self.meter_weights(w)
                meter.add((w > 0).sum(), w.sum(), **sums)
        engine.train()
        result = meter.reduce()
        return {f"eval_{name}": result[name] for name in self.metrics}


class SequencePairStep(Sliced, PreferenceStep):
    """PreferenceStep on a rank that holds a slice of every pair's sequences (sequence parallelism): the policy and
    the reference on the slice, their log-probabilities summed over the group before the loss (Group.whole: each
    rank backpropagates the pairs' loss through its own slice), the meters counting the group's first rank."""

    def forward(self, engine, loss, inputs: list, labels: torch.Tensor) -> tuple:
        """(this slice's logits, or their TokenSums; each sequence's log-probability and token count on the
        slice)."""
        logits, targets = self.on_slice(engine, inputs, labels)
        return logits, target_logps(logits, targets)

    def answer_logps(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return counted_at_least_one(self.group.whole(super().answer_logps(ids, labels)))

    def batch_loss(self, batch) -> tuple:
        """Every rank of the group holds the pairs' whole loss: the meters take the first rank's sums."""
        loss, sums, w = super().batch_loss(batch)
        return loss, {name: self.group.counted(value) for name, value in sums.items()}, w


class Preference(AgainstReference):
    """Pairs of answers to one prompt (app/data/preference.py) on a causal language model, the model as for
    instruction data; the DPO family's losses against a reference."""
    name = "preference"
    sequences = 2
    loss = staticmethod(answer_logps)  # the step's forward gives each sequence's terms; pair_losses combines them
    log_columns = (*METRICS[1:], *(f"eval_{name}" for name in METRICS[1:]))
    summary_metrics = ("eval_loss", "eval_reward_accuracy")
    splits_sequences = tiled_loss = True

    def __init__(self, settings: Settings, spec, data=None, tokenizer=None):
        """What the settings ask of the loss and the reference; a frozen copy comes with before_search()."""
        super().__init__(settings, spec, data, tokenizer)
        self.loss_kind, self.beta, self.gamma = settings.preference_loss, settings.beta_or(0.1), settings.simpo_gamma
        if self.beta <= 0:
            raise UserError(f"--beta must be above 0 (0.1 is usual for DPO, 2 for SimPO), got {self.beta:g}")
        self.frozen = None
        self.reference_kind = "none (SimPO)" if self.loss_kind == "simpo" else \
            "precomputed" if settings.reference == "precompute" else \
            "adapters off" if settings.lora else "frozen copy"

    def check_layout(self, ranks):
        super().check_layout(ranks)
        if ranks.split or ranks.tensor > 1:
            raise UserError("preference pairs train under data parallel and ZeRO 0-3, not pipeline stages or tensor "
                            "parallelism: pick a ds_config without a pipeline or tensor_parallel section")

    def flops_per_sample(self, model: nn.Module, info) -> float:
        """A pair's training FLOPs: two sequences forward and backward, and a live reference's forward of both."""
        sequence = models.train_flops_per_token(model, info.seq_len) * info.seq_len
        if self.reference_kind in ("adapters off", "frozen copy"):
            sequence += models.train_flops_per_token(model, info.seq_len, forward_only=True) * info.seq_len
        return 2 * sequence

    def build_model(self, info, ds_config: dict) -> nn.Module:
        """As for any text task, its dropout off (the model and the reference must score an answer alike, as TRL's
        disable_dropout does); a preset's weights drawn from --seed alone, so a frozen copy is the same model."""
        with lora.seeded(self.settings.seed) if not self.spec.pretrained else contextlib.nullcontext():
            return without_dropout(super().build_model(info, ds_config))

    def before_load(self, engine, ds: dict, output_dir):
        """While the engine holds the base model's weights: the precomputed log-probabilities; says which reference
        the run trains against."""
        if self.reference_kind == "precomputed":
            reference.precompute(lambda: Reference(engine, adapters_off=self.settings.lora, group=Group.of(engine),
                                                   fused=self.fused_logits),
                                 [self.data.train, self.data.held_out], self.base(), compute_dtype(engine),
                                 ds["train_micro_batch_size_per_gpu"], output_dir)
        dist.print0(f"preference: {self.loss_kind} loss, beta {self.beta:g}"
                    f"{f', gamma {self.gamma:g}' if self.loss_kind == 'simpo' else ''}; reference: "
                    f"{self.reference_kind}")

    def eager_because(self, stage: int) -> str:
        """Under ZeRO-3, LoRA's reference forward inside the compiled step ended both ranks with a segmentation
        fault on an H100 (docs/preference-tuning.md, "On a GPU"); eager, the same run trains."""
        if self.reference_kind == "adapters off" and stage == 3:
            return "LoRA's reference (the adapters off) inside ZeRO-3's compiled step crashed on a GPU"
        return ""

    def make_step(self, engine, compile_model: bool, board=None) -> TrainStep:
        return PreferenceStep(engine, self, compile_model, board)

    def make_sequence_step(self, engine, compile_model: bool, board=None) -> TrainStep:
        return SequencePairStep(engine, self, compile_model, board)

    def answer_prompts(self, count: int) -> list:
        return answer_prompts(self.data.held_out, count)

    def base(self) -> str:
        """What identifies the base model the reference is (app/core/lora.py's fingerprint)."""
        return lora.fingerprint(self.settings.model, self.spec.pretrained, self.settings.seed, self.spec.config)

    def record(self) -> dict:
        """The loss, beta, gamma, the reference and its base: a resume must train with the same."""
        return {"loss": self.loss_kind, "beta": self.beta, "gamma": self.gamma, "reference": self.reference_kind,
                "base": self.base()}

    def sample_data(self, samples: int, seq_len: int) -> tuple:
        raise UserError("the benchmark runs image classifiers and causal language models on blocks of text; "
                        "leave --task preference out")
