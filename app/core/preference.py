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

from app.core.step import TrainStep
from app.ds import internals as ds_internals
from app.data.chat import IGNORE
from app.observe.metrics import Meter

LOSSES = ("sigmoid", "ipo", "hinge", "simpo")
METRICS = ["loss", "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy"]


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(sequences, 2): each sequence's log-probability of its labelled tokens (summed, in fp32) and how many
    there are."""
    rows, targets = logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1)
    logp = -F.cross_entropy(rows.float(), targets, reduction="none", ignore_index=IGNORE)
    counted = (labels[:, 1:] != IGNORE).sum(1).clamp(min=1).float()
    return torch.stack([logp.view(len(logits), -1).sum(1), counted], 1)


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


def reference_dict(ds: dict, replicas: int) -> dict:
    """The DeepSpeed dict of a frozen reference: the policy's precision and, under ZeRO-3, its partitioning (and
    parameter offload); no optimizer, scheduler nor optimizer state to shard; batch sizes of one (it never steps,
    and is built before the policy's micro batch is settled)."""
    ref = {k: v for k, v in ds.items() if k not in ("optimizer", "scheduler")}
    ref.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=replicas)
    zero = ds.get("zero_optimization") or {}
    ref["zero_optimization"] = {k: v for k, v in zero.items() if k != "offload_optimizer"} \
        if zero.get("stage", 0) == 3 else {"stage": 0}
    return ref


class Reference:
    """The reference's log-probabilities of a micro batch's sequences, under no_grad, eager, in eval mode.
    engine: the policy's engine (adapters_off: its LoRA adapters switched off) or a frozen copy's."""

    def __init__(self, engine, adapters_off: bool):
        self.engine, self.adapters_off = engine, adapters_off

    def __call__(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        engine = self.engine
        training = engine.module.training
        off = engine.module.hf.disable_adapter() if self.adapters_off else contextlib.nullcontext()
        engine.eval()
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"), off:
                # the policy's own engine: its forward counts as part of the policy's step (ZeRO-3's gather order)
                logits = ds_internals.forward_within_the_step(engine, ids) if self.adapters_off else engine(ids)
                return answer_logps(logits, labels)[:, 0]
        finally:
            engine.train(training)


class PreferenceStep(TrainStep):
    """A micro step on pairs: the two answers of each pair through the policy in one forward, the reference's
    log-probabilities (live, or read from the batch once precomputed), the loss weighted so the step's loss is the
    mean over its pairs however they split; the rewards summed beside it."""
    metrics = METRICS

    def __init__(self, engine, task, compile_model: bool, board=None):
        super().__init__(engine, task, compile_model, board)
        self.reference = task.live_reference(engine)

    def batch_loss(self, batch) -> tuple:
        """(the micro batch's weighted loss, its sums for the meter, its weights)."""
        x, (labels, given), w = batch
        device = self.engine.device
        ids = x.to(device, non_blocking=True).flatten(0, 1)  # (pairs x 2, length): chosen, rejected, chosen, ...
        labels = labels.to(device, non_blocking=True).flatten(0, 1)
        w = w.to(device, non_blocking=True)
        reference = self.reference(ids, labels).view(-1, 2) if self.reference is not None else \
            given.to(device, non_blocking=True)
        _, policy = self.logits_and_losses([ids], labels)
        task = self.task
        losses, chosen, rejected = pair_losses(task.loss_kind, task.beta, task.gamma, policy.view(-1, 2, 2),
                                               reference)
        sums = {"loss": (losses.detach() * w).sum(), "rewards_chosen": (chosen.detach() * w).sum(),
                "rewards_rejected": (rejected.detach() * w).sum(),
                "reward_margin": ((chosen - rejected).detach() * w).sum(),
                "reward_accuracy": ((chosen > rejected).float() * w).sum()}
        return (losses * w).sum(), sums, w

    def evaluate(self, loader) -> dict:
        """The held-out pairs' loss and rewards over every rank's shard, padding excluded: means over pairs."""
        engine = self.engine
        meter = Meter(self.metrics, engine.device)
        engine.eval()
        with torch.no_grad():
            for batch in loader:
                _, sums, w = self.batch_loss(batch)
                meter.add((w > 0).sum(), w.sum(), **sums)
        engine.train()
        result = meter.reduce()
        return {f"eval_{name}": result[name] for name in self.metrics}


class Preference:
    """The task of preference pairs on a causal language model (a TextTask, app/core/tasks.py): the data
    (app/data/preference.py), the model as for instruction data, the loss and its reference."""
    name = "preference"
    loss = staticmethod(answer_logps)
    step = PreferenceStep
    log_columns = (*METRICS[1:], *(f"eval_{name}" for name in METRICS[1:]))
    """metrics.csv's columns besides every task's."""

    def settle(self):
        """What the settings ask of the loss and the reference; the reference's engine comes with prepare()."""
        settings = self.settings
        self.loss_kind, self.beta, self.gamma = settings.preference_loss, settings.beta, settings.simpo_gamma
        self.frozen, self.info = None, None
        self.reference_kind = "none (SimPO)" if self.loss_kind == "simpo" else \
            "precomputed" if settings.reference == "precompute" else \
            "adapters off" if settings.lora else "frozen copy"

    def live_reference(self, engine):
        """The Reference a step asks for each micro batch: None when the batch brings it (precomputed), when the
        loss needs none, or before prepare() (the micro batch search's trials)."""
        if self.reference_kind == "adapters off":
            return Reference(engine, adapters_off=True)
        return Reference(self.frozen, False) if self.reference_kind == "frozen copy" and self.frozen else None

    def build_reference(self, ds: dict, replicas: int, info):
        """The frozen copy, when the run trains against one: built before the micro batch is searched, so the
        search's trial steps carry it as the run will. info: the DataInfo the model is shaped for."""
        from app.core import reference
        self.info = info
        if self.reference_kind == "frozen copy":
            self.frozen = reference.frozen_copy(self, ds, replicas)

    def prepare(self, engine, ds: dict, output_dir):
        """Before training and before a checkpoint is loaded, while the engine holds the base model's weights: the
        precomputed log-probabilities; says which reference the run trains against."""
        from app.core import reference
        from app.distributed import dist
        from app.ds.precision import compute_dtype
        kind = self.reference_kind
        if kind == "precomputed":
            reference.precompute(lambda: Reference(engine, adapters_off=self.settings.lora),
                                 [self.train_set, self.eval_set], self.base(), compute_dtype(engine),
                                 ds["train_micro_batch_size_per_gpu"], output_dir)
        dist.print0(f"preference: {self.loss_kind} loss, beta {self.beta:g}"
                    f"{f', gamma {self.gamma:g}' if self.loss_kind == 'simpo' else ''}; reference: {kind}")

    def eager_because(self, engine) -> str:
        """Why the run trains eager whatever --compile asks ('' where it may compile): under ZeRO-3, LoRA's
        reference forward inside the compiled step ended both ranks with a segmentation fault on an H100
        (docs/preference-tuning.md, "On a GPU"); eager, the same run trains."""
        if self.reference_kind == "adapters off" and engine.zero_optimization_stage() == 3:
            return "LoRA's reference (the adapters off) inside ZeRO-3's compiled step crashed on a GPU"
        return ""

    def base(self) -> str:
        """What identifies the base model the reference is (app/core/lora.py's fingerprint)."""
        from app.core import lora
        return lora.fingerprint(self.settings.model, self.spec.pretrained, self.settings.seed, self.spec.config)

    def record(self) -> dict:
        """What a checkpoint records of the preference run: the loss, beta, the reference and its base."""
        return {"loss": self.loss_kind, "beta": self.beta, "gamma": self.gamma, "reference": self.reference_kind,
                "base": self.base()}

    def eval_metrics(self, loss: float) -> dict:
        return {}

    def sample_data(self, samples: int, seq_len: int) -> tuple:
        from app.errors import UserError
        raise UserError("the benchmark runs image classifiers and causal language models on blocks of text; "
                        "leave --task preference out")
