"""Online RL with verifiable rewards (--task grpo): for each prompt a group of completions sampled from the model,
scored by the user's reward functions, and the model moved towards the completions that beat their group's mean
(GRPO, and its DAPO and Dr. GRPO normalisations), as TRL's GRPOTrainer does; docs/rl.md."""
import contextlib
from pathlib import Path

import torch
from torch import nn

from app.core import grpo_kept, lora, models, rewards, rollout
from app.core.grpo_sequence import SequenceGrpoStep
from app.core.grpo_step import GrpoStep
from app.core.reference import AgainstReference
from app.core.step import TrainStep
from app.core.tasks import next_token_loss, without_dropout
from app.distributed import dist
from app.ds import internals as ds_internals, precision
from app.errors import UserError
from app.observe import metrics
from app.settings import Settings


class Grpo(AgainstReference):
    """Prompts (app/data/prompts.py) on a causal language model; a sample is a prompt and its group."""
    name = "grpo"
    loss = staticmethod(next_token_loss)  # the memory plan's stand-in: the logits of whole sequences and their softmax
    summary_metrics = ("eval_reward",)
    splits_sequences = True

    def __init__(self, settings: Settings, spec, data=None, tokenizer=None):
        self.sequences = self.group = self.sampled = settings.num_generations
        super().__init__(settings, spec, data, tokenizer)
        self.check(settings, rewarded=False)  # a run's needs --reward (app/core/resolver.py); the plan's does not
        self.rewards = rewards.load(settings.reward, settings.reward_weights) if settings.reward else []
        self.loss_kind, self.beta = settings.grpo_loss, settings.beta_or(0.0)
        self.epsilon, self.epsilon_high = settings.epsilon, settings.epsilon_high or settings.epsilon
        self.how = rollout.Sampling(settings.temperature, settings.top_k, settings.top_p,
                                    settings.max_completion_length)
        self.mask_truncated = settings.mask_truncated_completions
        self.kept = None  # the completions of the current cycle of --num_iterations steps (app/core/grpo_kept.py)
        self.reference_kind = "" if not self.beta else "adapters off" if settings.lora else "frozen copy"
        shown = ["reward", "reward_std", "frac_reward_zero_std", *(f"rewards/{r.name}/mean" for r in self.rewards),
                 "completions/mean_length", "completions/clipped_ratio", "clip_ratio/low_mean",
                 "clip_ratio/high_mean", "clip_ratio/region_mean", *(["kl"] if self.beta else []), "sampling_s"]
        self.metrics = ["loss", *shown]
        evaluated = ["reward", "completions/mean_length", *(f"rewards/{r.name}/mean" for r in self.rewards)]
        self.log_columns = (*shown, *(f"eval_{name}" for name in evaluated))

    @staticmethod
    def check(settings: Settings, rewarded: bool = True):
        """The settings GRPO refuses, one line each (before the data is read: app/core/resolver.py); rewarded: a run's,
        which needs --reward."""
        if rewarded:
            rewards.require(settings.reward)
        beta = settings.beta_or(0.0)
        if beta < 0 or settings.epsilon <= 0 or settings.epsilon_high < 0:
            raise UserError(f"--beta must be 0 or more (0: no KL term), --epsilon above 0 and --epsilon_high 0 or "
                            f"more; got {beta:g}, {settings.epsilon:g}, {settings.epsilon_high:g}")
        if settings.temperature <= 0 or not 0 < settings.top_p <= 1 or settings.top_k < 0:
            raise UserError(f"--temperature must be above 0, --top_p above 0 and at most 1, --top_k 0 or more; got "
                            f"{settings.temperature:g}, {settings.top_p:g}, {settings.top_k}")
        if settings.num_iterations < 1:
            raise UserError(f"--num_iterations must be at least 1 (optimizer steps on each batch of completions), got "
                            f"{settings.num_iterations}")
        if settings.packing == "on":
            raise UserError("--packing on packs instruction rows; GRPO's prompts are sampled as they are: leave "
                            "--packing auto")

    def check_layout(self, ranks):
        super().check_layout(ranks)
        if ranks.split or ranks.tensor > 1:
            raise UserError("--task grpo trains under data parallel and ZeRO 0-3, not pipeline stages or tensor "
                            "parallelism: pick a ds_config without a pipeline or tensor_parallel section")

    def synced(self, engine) -> bool:
        """Whether sampling must keep every rank stepping until all have ended: ZeRO-3 on several ranks (replicas,
        or the ranks of a sequence-parallel group, which sample shares of their completions)."""
        return engine.zero_optimization_stage() == 3 and dist.world_size() > 1

    def gathering(self, engine) -> bool:
        """Whether sampling gathers the whole model once under ZeRO-3 (--gather_for_generation; auto: where, on
        every rank, the whole weights and the key-value cache of a micro batch's completions (under sequence
        parallelism, the rank's share) fit in the memory free now, beside the partitions). A collective under
        auto."""
        if not hasattr(engine, "app_gathers_for_sampling"):  # decided once an engine
            setting = self.settings.gather_for_generation
            gathers = engine.zero_optimization_stage() == 3 and setting != "off"
            if gathers and setting == "auto":
                element = torch.empty((), dtype=precision.compute_dtype(engine)).element_size()
                rows = -(-engine.train_micro_batch_size_per_gpu() * self.group // engine.sequence_parallel_size)
                need = ds_internals.whole_bytes(engine) + rollout.cache_bytes(self.spec.config, rows,
                                                                              self.data.info.seq_len, element)
                gathers = dist.host_max([int(need > metrics.free_memory_bytes(engine.device))])[0] == 0
            engine.app_gathers_for_sampling = gathers
        return engine.app_gathers_for_sampling

    def build_model(self, info, ds_config: dict) -> nn.Module:
        """As for any text task, its dropout off (the completions' log-probabilities are the model's own); a
        preset's weights drawn from --seed alone, so a frozen copy is the same model."""
        with lora.seeded(self.settings.seed) if not self.spec.pretrained else contextlib.nullcontext():
            return without_dropout(super().build_model(info, ds_config))

    def flops_per_sample(self, model: nn.Module, info) -> float:
        """A prompt's FLOPs a step: its group's sequences forward and backward, the sampling's forwards of each
        completion token (with the cache), and a reference's forward of the sequences. Under --num_iterations mu
        a cycle samples once for its mu steps, with the old policy's forward of the sequences: a step's share."""
        sequence = models.train_flops_per_token(model, info.seq_len) * info.seq_len
        forward = models.train_flops_per_token(model, info.seq_len, forward_only=True)
        repeats = self.settings.num_iterations
        sampled = (forward * self.how.max_new + (forward * info.seq_len if repeats > 1 else 0.0)) / repeats
        return self.group * (sequence + sampled + (forward * info.seq_len if self.beta else 0.0))

    def before_load(self, engine, ds: dict, output_dir):
        """Says how the run samples and what it trains against; --log_completions writes in output_dir."""
        self.output_dir = output_dir
        weights = ", ".join(f"{r.name} x {r.weight:g}" for r in self.rewards)
        dist.print0(f"grpo: {self.loss_kind} loss, {self.group} completions of at most {self.how.max_new} tokens a "
                    f"prompt (temperature {self.how.temperature:g}); rewards {weights}; beta {self.beta:g}, "
                    f"reference: {self.reference_kind or 'none'}")
        if engine.zero_optimization_stage() == 3:
            dist.print0("grpo: sampling gathers the whole model once a micro batch" if self.gathering(engine) else
                        "grpo: sampling gathers the model layer by layer for each token, every rank in step "
                        "(--gather_for_generation)")

    def eager_because(self, stage: int) -> str:
        return "completions are sampled inside the step (eager)"

    def make_step(self, engine, compile_model: bool, board=None) -> TrainStep:
        return GrpoStep(engine, self, compile_model, board)

    def make_sequence_step(self, engine, compile_model: bool, board=None) -> TrainStep:
        return SequenceGrpoStep(engine, self, compile_model, board)

    def answer_prompts(self, count: int) -> list:
        held = self.data.held_out
        return [(held.ids[i], []) for i in range(min(count, len(held)))]

    def record(self) -> dict:
        """What a resume must train with: the loss and its settings, the sampling, the rewards (names, weights and
        their files' sha256), the reference and its base, and --num_iterations above 1 (app/checkpoint/resume.py
        then keeps the windows too)."""
        s = self.settings
        return {"task": "grpo", "grpo_loss": self.loss_kind, "beta": self.beta, "epsilon": self.epsilon,
                "epsilon_high": self.epsilon_high, "num_generations": self.group,
                "max_completion_length": self.how.max_new, "temperature": self.how.temperature,
                "top_p": self.how.top_p, "top_k": self.how.top_k, "scale_rewards": s.scale_rewards,
                "mask_truncated_completions": self.mask_truncated,
                "reward": [[r.name, r.weight, r.digest] for r in self.rewards], "reference": self.reference_kind,
                "base": lora.fingerprint(s.model, self.spec.pretrained, s.seed, self.spec.config),
                **({"num_iterations": s.num_iterations} if s.num_iterations > 1 else {})}  # 1: as records before it

    def save_rank_files(self, engine, folder: Path):
        """Inside a cycle of --num_iterations steps, what this rank keeps of its completions, for a resume to end
        the cycle on them."""
        if engine.global_steps % self.settings.num_iterations:
            self.kept.save(folder / f"grpo_kept_rank{dist.rank():05d}.pt")

    def load_rank_files(self, engine, folder: Path):
        """Every rank's kept completions of the checkpoint's cycle (any world size saved them), where it stopped
        inside one."""
        if engine.global_steps % self.settings.num_iterations:
            paths = sorted(folder.glob("grpo_kept_rank*.pt"))
            if not paths:
                raise UserError(f"{folder} stopped inside a cycle of --num_iterations {self.settings.num_iterations} "
                                f"steps but holds no kept completions (grpo_kept_rank*.pt); resume an earlier "
                                f"checkpoint")
            self.kept = grpo_kept.Kept.load(paths)

    def sample_data(self, samples: int, seq_len: int) -> tuple:
        raise UserError("the benchmark runs image classifiers and causal language models on blocks of text; "
                        "leave --task grpo out")
