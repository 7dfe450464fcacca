"""Sequence parallelism through DeepSpeed's Ulysses (deepspeed.runtime.sequence_parallel.ulysses_sp): the JSON's
"sequence_parallel_size": N splits each sequence over N consecutive ranks. Each rank holds T/N of its tokens, and
inside attention all T tokens of heads/N heads (DeepSpeed's all-to-all before and after each attention).

This module checks the degree and the model and routes the model's attention through Ulysses; the step of a rank
that holds a slice of each sequence, and how the losses split over the slices, are app/core/sequence_step.py's.
"""
import inspect

from torch import nn

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
    _mixes_within_attention(model, text, f"{KEY} {degree}: {model_name}")
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads % degree or (kv % degree and degree % kv):
        raise UserError(f"{KEY} {degree}: {model_name} has {heads} attention heads ({kv} key/value heads), which "
                        f"do not split over {degree} ranks; use a {KEY} that divides {heads} (and {kv}, or that "
                        f"{kv} divides)")


SEQUENCE_ROPE = ("dynamic", "longrope")
"""RoPE types whose frequencies follow the length of the positions a forward is given (each rank's slice)."""


def _mixes_within_attention(model, text, said: str):
    """One line unless every token meets the others in attention alone, through transformers' registry, with
    positions whose rotations do not depend on the slice: no convolution or state-space layer along the sequence
    (LFM2's short convolutions, Mamba hybrids, Qwen3-Next's linear attention), no attention that calls torch
    itself (Falcon), no heads of other widths (DeepSeek's latent attention), no RoPE scaled by the length."""
    mixers = sorted({type(parent).__name__ for parent in model.modules()
                     if any(isinstance(child, nn.Conv1d) for child in parent.children())})
    if mixers:
        raise UserError(f"{said} mixes tokens in {mixers[0]} (a convolution or state space along the sequence), "
                        f"outside the attention DeepSpeed's Ulysses gathers: each rank would see its slice alone; "
                        f"train it without {KEY}")
    direct = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")
                     and "ALL_ATTENTION_FUNCTIONS" not in _source(type(m).forward)})
    if direct:
        raise UserError(f"{said}: {direct[0]} computes attention itself, not through transformers' attention "
                        f"registry that DeepSpeed's Ulysses takes over; train it without {KEY}")
    if getattr(text, "kv_lora_rank", None) or getattr(text, "v_head_dim", None):
        raise UserError(f"{said} has query, key and value heads of different widths (latent attention), which "
                        f"DeepSpeed's Ulysses does not split; train it without {KEY}")
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind in SEQUENCE_ROPE:
        raise UserError(f"{said} scales its RoPE by the length of the positions it is given ({kind}): each rank "
                        f"would rotate its slice by its own length; train it without {KEY}")


def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):  # no source to read: taken as going through the registry
        return "ALL_ATTENTION_FUNCTIONS"


def attach(model, degree: int, model_name: str):
    """Route the model's attention through DeepSpeed's Ulysses over the sequence-parallel group (the model, built
    for the JSON, takes each rank's slice of the positions as its second input: app/core/models.py build_hf)."""
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
        # the mask transformers made is for this rank's slice: causal attention over the gathered positions; the
        # key/value groups DeepSpeed sets on the module for the gathered heads are put back for plain attention
        # (GRPO's sampling, app/ds/internals/sequence.py whole_sequences)
        groups = getattr(module, "num_key_value_groups", None)
        try:
            return by_batch[batch](module, query, key, value, None, *args, **kwargs)
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
    ulysses.app_core = core
    ALL_ATTENTION_FUNCTIONS[attention] = ulysses


def settings_for(settings, degree: int):
    """settings as a run whose sequences are split takes them: --packing auto off (DeepSpeed's Ulysses drops the
    attention mask that keeps packed rows apart), said in a line."""
    if degree == 1 or settings.packing != "auto":
        return settings
    from dataclasses import replace
    from app.distributed import dist
    dist.print0(f"packing: off: {KEY} {degree} splits each row over ranks, and DeepSpeed's Ulysses drops the "
                f"attention mask that keeps packed rows apart")
    return replace(settings, packing="off")


def describe(degree: int, replicas: int) -> str:
    """The start-up line of a sequence-parallel run."""
    return (f"sequence parallel: DeepSpeed Ulysses splits each sequence over {degree} ranks x {replicas} "
            f"data-parallel replica(s)")

