"""The plan's notes above its table (app/tools/plan.py): how sequence parallelism splits a text model's sequence,
what a sample and the reference are in preference tuning and online RL, and how the activations were counted."""
from app.memory import planner


def sequence_notes(args, task) -> list:
    """The heading's lines on a text model's sequence: how sequence parallelism splits it, and a length past the
    model's positions (which a run refuses as --block_size)."""
    if not task.spec:
        return []
    seq, degree, positions = planner.tokens_per_sample(task.spec, args.seq_len), args.sequence_parallel, \
        task.spec.max_positions
    notes = [f"sequence parallel: seq {seq} over {degree} ranks: {seq // degree} tokens per rank, whose activations "
             f"act/sample counts; ZeRO 1-3 partition over all {args.world_size} ranks"] if degree > 1 else []
    if positions and seq > positions:
        notes.append(f"seq {seq} is longer than {args.model}'s {positions} positions: train.py refuses a "
                     f"--block_size above them; planned as a model saved with more (max_position_embeddings)")
    return notes


def task_notes(task) -> list:
    """The heading's line on what a sample is in preference tuning and online RL, and the reference they hold."""
    reference = task.reference_kind
    held = f"; reference: {reference}, {REFERENCES[reference]}" if reference else ""
    if task.name == "preference":
        return [f"preference pairs: act/sample is a pair's two sequences{held}"]
    if not task.sampled:
        return []
    gathered = " (and under ZeRO-3 the whole weights, gathered)" if task.settings.gather_for_generation != "off" else ""
    return [f"grpo: act/sample is a prompt's {task.sampled} sequences of seq_len tokens, prompt and completion; "
            f"sampling them first holds their key-value cache{gathered}; peak is the larger of sampling and "
            f"training{held}"]


# What each reference of preference tuning and online RL (the task's reference_kind) holds while training.
REFERENCES = {"frozen copy": "its weights per rank in the ref column, in the config's weight precision (partitioned "
                             "under ZeRO-3; in the host column with offload_param)",
              "adapters off": "the model itself with its LoRA adapters off: no memory of its own",
              "precomputed": "log-probabilities computed once before training: no model while training",
              "none (SimPO)": "SimPO's loss needs none"}


def activation_notes(plans: dict) -> list:
    """The lines below the table on how act/sample was counted: as torch.compile's forward graph keeps it, or eager (under
    CUDA's autocast rules either way), for each way some row was counted."""
    said = {"compiled": "the compiled step's (--compile auto or on: the tensors torch.compile's forward graph keeps "
                        "for the backward)",
            "eager": "the eager step's (--compile off, activation checkpointing, or a task that trains eager)"}
    ways = dict.fromkeys(plan.counted for plan in plans.values())
    return [f"act/sample: {said.get(way, way)}" for way in ways]
