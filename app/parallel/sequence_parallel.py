"""Sequence parallelism through DeepSpeed's Ulysses (deepspeed.runtime.sequence_parallel.ulysses_sp): the JSON's
"sequence_parallel_size": N splits each sequence over N consecutive ranks. Each rank holds T/N of its tokens, and
inside attention all T tokens of heads/N heads (DeepSpeed's all-to-all before and after each attention).

The N ranks of a group are one data-parallel replica: they load the same micro batch, and each takes its slice of
the positions. The next-token targets are shifted over the whole sequence first, so the last token of a slice
predicts the first token of the next. A rank's loss is its slice's share of each sample's mean (its tokens' losses
over the sample's counted tokens in the whole sequence); DeepSpeed sums the gradients over all ranks and divides by
the replicas, so a step's gradient is the one SP=1 takes on the same global batch.
"""
import torch
import torch.nn.functional as F

from app.core.fused_loss import TokenSums
from app.core.step import TrainStep
from app.core.tasks import counted_next_tokens as counted  # over each sample's whole sequence
from app.data.chat import IGNORE
from app.errors import UserError

KEY = "sequence_parallel_size"
ATTENTIONS = ("sdpa", "flash_attention_2", "flash_attention_3")
"""The attention implementations the app splits with DeepSpeed's Ulysses: causal over the gathered sequence without a
mask (eager builds a whole-sequence mask Ulysses cannot split; flex_attention without its block mask attends both
ways)."""
MASKED = ("sliding_window", "attn_logit_softcapping")
"""Config keys of attention that a plain causal mask does not give (Mistral's window, Gemma 2's soft cap), which only
flash-attention keeps without the mask Ulysses drops."""


def size(ds: dict, world_size: int, where: str) -> int:
    """The sequence-parallel degree the JSON asks for (1 without the key), checked against the world."""
    degree = ds.get(KEY, 1)
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise UserError(f"{where}: {KEY} must be a positive integer, got {degree!r}")
    if degree > 1 and world_size % degree:
        raise UserError(f"{where}: {KEY} {degree} does not divide the world size {world_size}; launch a multiple "
                        f"of {degree} ranks, e.g. `deepspeed --num_gpus {degree} app/train.py ...`")
    if degree > 1 and ("pipeline" in ds or (ds.get("tensor_parallel") or {}).get("autotp_size", 1) > 1):
        raise UserError(f"{where}: the app runs {KEY} without \"pipeline\" or \"tensor_parallel\"; drop one")
    zero = ds.get("zero_optimization") or {}
    if degree > 1 and zero.get("stage") == 3 and zero.get("reduce_scatter", True) is False:
        raise UserError(f"{where}: {KEY} under ZeRO-3 takes DeepSpeed's reduce-scatter of gradients (its default); "
                        f"drop zero_optimization.reduce_scatter false")
    return degree


def check_model(model, degree: int, model_name: str):
    """One line unless the model's attention and head counts can be split over `degree` ranks."""
    config = getattr(getattr(model, "hf", None), "config", None)
    if config is None or not hasattr(config, "num_attention_heads"):
        raise UserError(f"{KEY} {degree}: {model_name} is not a transformers language model; Ulysses splits the "
                        f"sequences of causal language models (e.g. --model llama-tiny)")
    text = config.get_text_config()
    attention = text._attn_implementation
    if attention not in ATTENTIONS:
        raise UserError(f"{KEY} {degree}: {model_name} runs attention {attention!r}, which the app does not split "
                        f"with DeepSpeed's Ulysses (it splits {', '.join(ATTENTIONS)}); pass --attention sdpa")
    masked = [key for key in MASKED if getattr(text, key, None) and getattr(text, "use_sliding_window", True)]
    if masked and not attention.startswith("flash_attention"):
        raise UserError(f"{KEY} {degree}: {model_name} sets {masked[0]}, which attention {attention!r} keeps only "
                        f"through the mask DeepSpeed's Ulysses drops; pass --attention flash_attention_2")
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads % degree or (kv % degree and degree % kv):
        raise UserError(f"{KEY} {degree}: {model_name} has {heads} attention heads ({kv} key/value heads), which "
                        f"do not split over {degree} ranks; use a {KEY} that divides {heads} (and {kv}, or that "
                        f"{kv} divides)")


def attach(model, degree: int, model_name: str):
    """Route the model's attention through DeepSpeed's Ulysses over the sequence-parallel group, the model then
    taking position ids (each rank's slice of the positions) as its second input."""
    check_model(model, degree, model_name)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    text = model.hf.config.get_text_config()
    attention = text._attn_implementation
    core = ALL_ATTENTION_FUNCTIONS[attention]
    core = getattr(core, "app_core", core)  # a second model of the process: wrap the core once
    heads, kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    by_batch = {}

    def ulysses(module, query, key, value, attention_mask, *args, **kwargs):
        batch = query.shape[0]  # DeepSpeed's module is made for one batch size: one per size met
        if batch not in by_batch:
            by_batch[batch] = UlyssesSPAttentionHF(
                attn=core, batch_size=batch, attn_head_count=heads, kv_head_count=kv,
                attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
                num_hidden_layers=text.num_hidden_layers, process_group=mpu.get_sequence_parallel_group(),
                seq_length_is_variable=True)
            by_batch[batch].core_attn_implementation = attention
        # the mask transformers made is for this rank's slice: causal attention over the gathered positions
        return by_batch[batch](module, query, key, value, None, *args, **kwargs)
    ulysses.app_core = core
    ALL_ATTENTION_FUNCTIONS[attention] = ulysses
    model.second = "position_ids"


def sliced(inputs: list, labels: torch.Tensor, degree: int, rank: int) -> tuple:
    """(ids, positions, next-token targets) of this rank's slice of the micro batch; the sequence padded at its end
    to a multiple of degree with untrained positions."""
    ids = inputs[0]
    length = -(-ids.shape[1] // degree) * degree
    pad = length - ids.shape[1]
    targets = F.pad(labels[:, 1:], (0, pad + 1), value=IGNORE)
    ids = F.pad(ids, (0, pad), value=0)
    positions = torch.arange(length, device=ids.device).expand(ids.shape[0], -1)
    part = slice(rank * length // degree, (rank + 1) * length // degree)
    return ids[:, part], positions[:, part], targets[:, part]


class SequenceStep(TrainStep):
    """The step of a sequence-parallel rank: the model on its slice, the loss its share of each sample's mean;
    only the group's first rank counts the samples for the meters (the others add their losses' shares alone)."""

    def __init__(self, engine, task, compile_model: bool, board=None):
        self.degree, self.rank = engine.mpu.get_sequence_parallel_world_size(), engine.mpu.get_sequence_parallel_rank()
        # DeepSpeed 0.19.8's ZeRO-3 reduce-scatter averages gradients over every rank, where ZeRO 0-2 (and its own
        # all-reduce path) divide by the data-parallel replicas alone: its gradients come out 1/degree of the
        # sequence's, which Adam hides but clipping does not. The loss is scaled to make up for it.
        self.scale = self.degree if engine.zero_optimization_stage() == 3 else 1
        super().__init__(engine, task, compile_model, board)
        if self.compiler is not None:
            self.compiler.forward = self.forward

    def forward(self, engine, loss, inputs: list, labels: torch.Tensor) -> tuple:
        """(this slice's logits, or their TokenSums where the task fuses them with the loss; each sample's share of
        its mean next-token loss)."""
        ids, positions, targets = sliced(inputs, labels, self.degree, self.rank)
        if self.task.fused_logits:
            sums = engine(ids, positions, targets)
            return sums, sums.loss / counted(labels)
        logits = engine(ids, positions)
        losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none",
                                 ignore_index=IGNORE)
        return logits, losses.view(len(ids), -1).sum(1) / counted(labels)

    def batch_loss(self, batch) -> tuple:
        loss, sums, weights = super().batch_loss(batch)
        return loss * self.scale, sums, weights

    def logits_and_losses(self, inputs: list, labels: torch.Tensor) -> tuple:
        if self.compiler is not None:
            return self.compiler(inputs, labels)
        return self.forward(self.engine, None, inputs, labels)

    def with_targets(self, inputs: list, labels: torch.Tensor) -> list:
        return inputs  # forward slices the targets with the sequence

    def correct(self, logits, labels: torch.Tensor) -> torch.Tensor:
        """Each sample's share of its next tokens predicted right, on this slice."""
        if isinstance(logits, TokenSums):
            return logits.right / counted(labels)
        targets = sliced([labels], labels, self.degree, self.rank)[2]
        right = (logits.argmax(-1) == targets) & (targets != IGNORE)
        return right.sum(1) / counted(labels)

    def meter_weights(self, weights: torch.Tensor) -> torch.Tensor:
        return weights if self.rank == 0 else torch.zeros_like(weights)


def describe(degree: int, replicas: int) -> str:
    """The start-up line of a sequence-parallel run."""
    return (f"sequence parallel: DeepSpeed Ulysses splits each sequence over {degree} ranks x {replicas} "
            f"data-parallel replica(s)")

