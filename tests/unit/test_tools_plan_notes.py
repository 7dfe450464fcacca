"""The plan's notes (app/tools/plan_notes.py): what a sample of preference tuning and online RL is, the reference
each holds, how sequence parallelism splits a sequence, and how the activations were counted."""
from app.tools import plan as plan_tool
from app.tools.plan_notes import sequence_notes, task_notes


def notes(*flags) -> tuple:
    args = plan_tool.parse(["--model", "gpt2-tiny", "--seq_len", "128", "--gpu_memory", "10GB", *flags])
    task = plan_tool.task_of(args)
    return sequence_notes(args, task), task_notes(task)


def test_a_plain_run_has_no_notes_and_an_image_model_none_on_its_sequence():
    assert notes() == ([], [])
    args = plan_tool.parse(["--model", "cnn", "--gpu_memory", "10GB"])
    assert sequence_notes(args, plan_tool.task_of(args)) == []


def test_preference_and_grpo_say_what_a_sample_is_and_which_reference_they_hold():
    assert notes("--preference")[1] == ["preference pairs: act/sample is a pair's two sequences; reference: frozen "
                                        "copy, its weights per rank in the ref column, in the config's weight "
                                        "precision (partitioned under ZeRO-3; in the host column with offload_param)"]
    [line] = notes("--grpo", "--num_generations", "4")[1]
    assert line.startswith("grpo: act/sample is a prompt's 4 sequences of seq_len tokens, prompt and completion; "
                           "sampling them first holds their key-value cache (and under ZeRO-3 the whole weights, "
                           "gathered); peak is the larger") and "reference" not in line
    [line] = notes("--grpo", "--gather_for_generation", "off", "--beta", "0.1", "--lora")[1]
    assert "gathered" not in line and line.endswith("reference: adapters off, the model itself with its LoRA "
                                                    "adapters off: no memory of its own")


def test_sequence_parallelism_and_a_length_past_the_positions_are_said():
    split, _ = notes("--sequence_parallel", "2", "--world_size", "4")
    assert split == ["sequence parallel: seq 128 over 2 ranks: 64 tokens per rank, whose activations act/sample "
                     "counts; ZeRO 1-3 partition over all 4 ranks"]
    args = plan_tool.parse(["--model", "gpt2-tiny", "--seq_len", "1024", "--gpu_memory", "10GB"])
    [past] = sequence_notes(args, plan_tool.task_of(args))
    assert past.startswith("seq 1024 is longer than gpt2-tiny's 128 positions")


def test_the_lines_below_the_table_say_how_the_activations_were_counted_once_each_way():
    from app.memory.estimate import MemoryPlan
    from app.tools.plan_notes import activation_notes
    counted = ["compiled", "eager", "compiled", "eager (the compiled step could not be traced: X: y)"]
    lines = activation_notes({str(i): MemoryPlan(str(i), 1, {}, counted=way) for i, way in enumerate(counted)})
    assert len(lines) == 3 and lines[0].startswith("act/sample: the compiled step's (--compile auto or on")
    assert lines[1].startswith("act/sample: the eager step's (--compile off, activation checkpointing")
    assert lines[2] == "act/sample: eager (the compiled step could not be traced: X: y)"


def test_the_plan_counts_compiled_what_a_run_on_a_gpu_compiles():
    """--compile auto and on compile on a GPU; off, GRPO (sampling inside the step) and preference tuning's LoRA
    reference under ZeRO-3 train eager, and are planned so (the task's eager_because, asked of each config)."""
    from app.memory import planner

    def compiles(*flags, stage=0, choice="auto"):
        task = plan_tool.task_of(plan_tool.parse(["--model", "gpt2-tiny", "--gpu_memory", "10GB", *flags]))
        return planner.compiles_under(task, choice)({"zero_optimization": {"stage": stage}})
    assert compiles() and compiles(choice="on") and not compiles(choice="off")
    assert not compiles("--grpo")
    assert compiles("--preference", "--lora", stage=2) and not compiles("--preference", "--lora", stage=3)
    assert compiles("--preference", stage=3), "a frozen copy as the reference compiles under ZeRO-3"
