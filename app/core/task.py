"""The task contract: what every kind of training gives the core, each hook with a default.

train.py, the loop, the micro batch search, the memory plan and the tools call these hooks on every task, whatever
its kind; a new kind of training is a new subclass (docs/architecture.md, "Adding a task"). The hooks in the order a
run calls them: check_layout, build_model (many times: the micro batch search's trials, the reference, the run),
before_search, after_trial, flops_per_sample, before_load, eager_because, load_rank_files (on resume), make_step
(make_sequence_step under sequence parallelism), then, while training, loss, correct, eval_metrics, save_files and
save_rank_files; at the end, per_sample and summary_metrics.
"""
from pathlib import Path

from torch import nn

from app.core.sequence_step import SequenceStep
from app.core.step import TrainStep
from app.data import Data, DataInfo
from app.errors import UserError
from app.settings import Settings


class Task:
    """One kind of training: its data, model, loss, metrics, FLOPs, checkpoint files and the engines it needs."""
    name = ""
    """What the summary and the checkpoints call the task."""
    tokens_per_sample = 0
    """Tokens one sample trains on (0: not a token model); throughput and MFU count them."""
    bench_batch = 32
    """The global batch app.tools.bench uses unless told."""
    log_columns = ()
    """metrics.csv's columns besides every task's (loss, eval_loss, ...)."""
    summary_metrics = ("eval_loss", "eval_accuracy")
    """The summary values the run's last line shows, where the run has them."""
    reference_kind = ""
    """The model the loss compares the trained one with: '' (none), or how it is held ('frozen copy' is a second
    model in memory, which the plan counts)."""
    sampled = 0
    """Completions the run samples for each sample it trains on (online RL's group; 0: none), which the memory plan
    counts."""
    tiled_loss = False
    """Whether the loss can take, in place of the logits, the TokenSums of an output layer tiled with it
    (next_token_loss and answer_logps can): --tiled then runs them tile by tile."""
    fused_logits = False
    """Whether the step hands the model each micro batch's next-token targets, for the output layer and the loss to
    run tile by tile (--tiled: app/core/fused_loss.py); set by the layout on a task with a tiled_loss."""
    splits_sequences = False
    """Whether ranks that each hold a slice of every sequence can train the task (DeepSpeed's Ulysses: its step is
    make_sequence_step's)."""
    spec = None
    """The transformers model's HFSpec (app/core/models.py); None for other models."""
    tokenizer = None

    def __init__(self, settings: Settings, data: Data = None):
        """data: the run's, or None where the task serves a tool that brings its own (sample_data)."""
        self.settings, self.data = settings, data

    @staticmethod
    def loss(logits, labels):
        """Each sample's loss (a tensor of the micro batch's samples), in fp32."""
        raise NotImplementedError

    @staticmethod
    def correct(logits, labels):
        """Each sample's accuracy, 0.0 to 1.0."""
        raise NotImplementedError

    def build_model(self, info: DataInfo, ds_config: dict) -> nn.Module:
        """A fresh model for an engine of ds_config (the same weights each time from the same seed)."""
        raise NotImplementedError

    def sample_data(self, samples: int, seq_len: int) -> tuple:
        """(train set, DataInfo) for the benchmark, whatever the size asked."""
        raise UserError(f"the benchmark runs image classifiers and causal language models; {self.settings.model} "
                        f"trains as {self.name}")

    def check_layout(self, ranks):
        """Refuse, in one line, a rank layout (app/parallel/layout.py) the task cannot train under."""
        if self.data is not None and self.data.info.packed and ranks.split:
            raise UserError("packing and pipeline stages: a stage takes input ids alone, not the position ids that "
                            "keep packed rows apart; pass --packing off")
        if ranks.sequence > 1 and not self.splits_sequences:
            raise UserError(f"sequence parallelism (sequence_parallel_size {ranks.sequence}) splits the losses of "
                            f"--task causal_lm, instruction, preference and grpo, not {self.name}'s; pick a ds_config "
                            f"without sequence_parallel_size")
        if self.data is not None and self.data.info.packed and ranks.sequence > 1:
            raise UserError("packing and sequence parallelism: DeepSpeed's Ulysses drops the attention mask, and sdpa "
                            "then lets packed rows see each other; pass --packing off")

    def flops_per_sample(self, model: nn.Module, info: DataInfo) -> float:
        """Training FLOPs of one sample (0: unknown, no MFU)."""
        return 0.0

    def before_search(self, ds: dict, replicas: int):
        """Before the micro batch search: the engines the task holds besides the trained one, built so that the
        search's trial steps carry them as the run will (ds: the planned DeepSpeed dict)."""

    def after_trial(self):
        """After each trial step of the micro batch search: give back what a failed trial left in the task's own
        engines."""

    def before_load(self, engine, ds: dict, output_dir: Path):
        """Once the engine holds the initial weights, before a checkpoint loads into it (not called when the run
        has nothing left to train)."""

    def eager_because(self, stage: int) -> str:
        """Why a run under ZeRO stage `stage` trains eager whatever --compile asks ('' where it may compile); the
        memory plan asks it too, of each config."""
        return ""

    def make_step(self, engine, compile_model: bool, board=None) -> TrainStep:
        """The step the loop runs on each micro batch (app/core/step.py)."""
        return TrainStep(engine, self, compile_model, board)

    def make_sequence_step(self, engine, compile_model: bool, board=None) -> TrainStep:
        """The step under sequence parallelism, where each rank holds a slice of every sequence
        (app/core/sequence_step.py): a next-token loss's shares."""
        return SequenceStep(engine, self, compile_model, board)

    def eval_metrics(self, loss: float) -> dict:
        """Metrics an evaluation derives from its loss (perplexity)."""
        return {}

    def answer_prompts(self, count: int) -> list:
        """[(prompt ids, expected answer ids)] of the first held-out rows, whose answers each evaluation shows; []
        where the task has no answers to show."""
        return []

    def save_files(self, folder: Path):
        """Extra files rank 0 writes into each checkpoint: none."""

    def save_rank_files(self, engine, folder: Path):
        """Files each rank writes into each checkpoint, the state of its own a resume needs, each named
        <what>_rank<rank:05d>.<ext> (app/checkpoint/save.py: RANK_FILES; a resume on another world size carries
        them over): none."""

    def load_rank_files(self, engine, folder: Path):
        """On resume, once the engine holds the checkpoint in folder: read back what save_rank_files wrote."""

    def record(self) -> dict:
        """What a checkpoint records of the task's settings, which a resume must match (app/checkpoint/resume.py)."""
        return {}

    def per_sample(self) -> dict:
        """What one sample holds besides itself (rows, real tokens), for the summary's rates."""
        return {}
