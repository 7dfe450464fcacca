"""Precision "auto" weighed against a GPU's memory, worked out on fake tensors (no GPU needed): bf16 weights where
bf16 autocast's fp32 weights do not fit the micro batch and bf16 weights do, else the precision "auto" picked."""
import dataclasses

import pytest

from app.core import resolver
from app.ds import precision
from app.ds.config import DEFAULT_DS_CONFIG, load_ds_config
from app.errors import UserError
from app.memory import activation_count, estimate, planner
from app.settings import Settings

SETTINGS = Settings(model="gpt2-tiny", block_size=128)


def on_a_gpu(micro: int, path=DEFAULT_DS_CONFIG) -> tuple:
    """dp.json (or the config at path) as a GPU with bf16 resolves it, at a micro batch: (DeepSpeed dict, precision's
    note)."""
    ds = load_ds_config(path, resolve=False)
    ds, note = precision.resolve_precision({**ds, "train_micro_batch_size_per_gpu": micro}, "dp.json", cuda=True,
                                           bf16_ok=True)
    assert note.startswith(planner.AUTOCAST_BY_AUTO), note
    return ds, note


def peaks(micro: int) -> tuple:
    """The plan's peaks of the micro batch under autocast and with bf16 weights, on 1 rank."""
    ds, _ = on_a_gpu(micro)
    task = resolver.build(SETTINGS)
    found = planner.plans(planner.workload(task, 128), {"autocast": ds, "bf16": planner.with_bf16_weights(ds)}, 1)
    return found["autocast"].peak(micro), found["bf16"].peak(micro)


def test_bf16_weights_where_only_they_fit_and_the_first_line_says_why():
    autocast, bf16 = peaks(64)
    assert bf16 < autocast
    memory = int((autocast + bf16) / 2 / estimate.USABLE)
    ds, note = planner.weigh(*on_a_gpu(64), resolver.build(SETTINGS), SETTINGS, 1, memory)
    assert ds["bf16"] == {"enabled": True} and "torch_autocast" not in ds
    assert note.startswith("bf16 (torch_autocast \"auto\" gave way to bf16 weights: the memory plan puts a micro "
                           "batch of 64 at ") and "with bf16 weights, of " in note


@pytest.mark.parametrize("share", [2.0, 0.5])
def test_autocast_stays_where_it_fits_and_where_nothing_does(share):
    """Room for autocast: it stays (the more precise). Room for neither: it stays too, and the run's own
    out-of-memory handling says what to do."""
    autocast, _ = peaks(64)
    ds, note = on_a_gpu(64)
    assert planner.weigh(ds, note, resolver.build(SETTINGS), SETTINGS, 1, int(share * autocast / estimate.USABLE)) == (ds, note)


def test_only_auto_on_a_gpu_with_a_set_micro_batch_is_weighed():
    ds, note = on_a_gpu(64)
    task = resolver.build(SETTINGS)
    assert planner.weigh(ds, note, task, SETTINGS, 1, 0) == (ds, note), "no GPU"
    assert planner.weigh({**ds, "train_micro_batch_size_per_gpu": "auto"}, note, task, SETTINGS, 1, 10**6)[1] == note
    set_by_file = "bf16 autocast"  # torch_autocast enabled true in the file: the user chose
    assert planner.weigh(ds, set_by_file, task, SETTINGS, 1, 10**6) == (ds, set_by_file)
    image = resolver.build(Settings(model="cnn"))
    assert planner.weigh(ds, note, image, Settings(model="cnn"), 1, 10**6) == (ds, note), "image models: not weighed"


def test_lora_plans_a_frozen_model_whose_backward_keeps_fewer_activations():
    """Frozen weights take no gradient, so the forward keeps no input for one; the backward still reaches the
    input, as it reaches the adapters."""
    import torch
    task = resolver.build(SETTINGS)
    held = {frozen: activation_count.activation_bytes(*planner.workload(task, 128, frozen=frozen)[:3], 4,
                                                      torch.bfloat16, False) for frozen in (False, True)}
    assert 0 < held[True] < held[False]


def test_a_zero3_plan_counts_the_compiled_step_through_deepspeeds_linear():
    """ZeRO-3 runs F.linear as DeepSpeed's function (memory_efficient_linear, its default), whose backward keeps each
    layer's input as it came and the weight itself, not autocast's bf16 copies: a compiled llama keeps fewer bytes a
    sample and a micro batch than under ZeRO-2, the same with memory_efficient_linear false; torch's F.linear is back
    after the count."""
    import torch
    ds, _ = on_a_gpu(8, DEFAULT_DS_CONFIG.parent / "zero2.json")
    zero3 = {**ds, "zero_optimization": {"stage": 3}}
    torchs = {**ds, "zero_optimization": {"stage": 3, "memory_efficient_linear": False}}
    task = resolver.build(dataclasses.replace(SETTINGS, model="llama-tiny"))
    found = planner.plans(planner.workload(task, 128), {"zero2": ds, "zero3": zero3, "torchs": torchs}, 1,
                          compiles=lambda _: True)
    assert {plan.counted for plan in found.values()} == {"compiled"}
    assert found["zero3"].per_sample < found["zero2"].per_sample == found["torchs"].per_sample
    assert found["zero3"].fixed < found["zero2"].fixed == found["torchs"].fixed, "no bf16 copy of the weights"
    assert torch.nn.functional.linear is torch._C._nn.linear


def test_a_preference_run_is_weighed_with_its_pairs_and_its_frozen_copy():
    """A pair is two sequences and the reference a frozen copy of the weights (fp32 under autocast): on a GPU where
    the pairs fit under autocast only without the copy, and bf16 weights with a bf16 copy fit, the preference run
    takes bf16 weights; a plain run of the same micro batch keeps autocast."""
    pairs = Settings(model="gpt2-tiny", block_size=128, task="preference")
    task = resolver.build(pairs)
    ds, note = on_a_gpu(32)
    work, named = planner.workload(task, 128), {"autocast": ds, "bf16": planner.with_bf16_weights(ds)}
    alone, beside = (planner.plans(work, named, 1, reference=copy) for copy in (False, True))
    assert beside["autocast"].device["reference"] == beside["autocast"].device["weights"], "fp32, as the policy's"
    assert beside["bf16"].device["reference"] == beside["bf16"].device["weights"], "bf16, as the policy's"
    assert beside["bf16"].peak(32) < alone["autocast"].peak(32) < beside["autocast"].peak(32)
    assert peaks(32)[0] < alone["autocast"].peak(32) / 1.5, "32 pairs: about twice 32 plain samples' activations"
    memory = int((alone["autocast"].peak(32) + beside["autocast"].peak(32)) / 2 / estimate.USABLE)
    assert planner.weigh(ds, note, resolver.build(SETTINGS), SETTINGS, 1, memory) == (ds, note), "a plain run: autocast"
    weighed, said = planner.weigh(ds, note, task, pairs, 1, memory)
    assert weighed["bf16"] == {"enabled": True}, said
    assert f"{beside['autocast'].peak(32) / 1e9:.1f} GB a rank with autocast's fp32 weights" in said


def test_a_grpo_prompt_is_planned_as_its_group_of_sequences(tmp_path):
    """A GRPO sample is a prompt and its --num_generations completions, trained together: 4 of them hold about four
    times one sequence's activations."""
    reward = tmp_path / "r.py"
    reward.write_text("def one(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    grpo = resolver.build(Settings(model="gpt2-tiny", task="grpo", reward=f"{reward}:one", num_generations=4))
    plain = resolver.build(Settings(model="gpt2-tiny"))
    ds, _ = on_a_gpu(8)
    found = [planner.plans(planner.workload(task, 128), {"autocast": ds}, 1)["autocast"] for task in (grpo, plain)]
    assert 3 < found[0].per_sample / found[1].per_sample < 5


def test_a_grpo_plan_counts_the_sampling_cache_and_under_zero3_the_gathered_weights(tmp_path):
    """Before the group's training forward, sampling holds each completion's key-value cache, and under ZeRO-3 the
    whole weights gathered once; a task that samples nothing plans none; under sequence parallelism a rank samples
    its share of the group's completions."""
    reward = tmp_path / "r.py"
    reward.write_text("def one(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    settings = Settings(model="gpt2-tiny", task="grpo", reward=f"{reward}:one", num_generations=4)
    grpo = resolver.build(settings)
    assert planner.sampling_of(resolver.build(Settings(model="gpt2-tiny")), 128) is None
    sampling, config = planner.sampling_of(grpo, 128), grpo.spec.config
    cache = 2 * config.n_layer * config.n_embd * 128 * 4 * 2  # key and value, every layer, 128 tokens, 4 rows, bf16
    scores = 4 * config.vocab_size * 28
    autocast = {"torch_autocast": {"enabled": True}, "zero_optimization": {"stage": 0}}
    assert sampling(autocast, 1000, 2) == (0, cache + scores), "ZeRO 0-2 hold the whole weights already"
    zero3 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    assert sampling(zero3, 1000, 4) == (2000 - 500, cache + scores), "bf16 weights, a quarter of them held already"
    grpo.settings.gather_for_generation = "off"
    assert sampling(zero3, 1000, 4)[0] == 0, "sampled layer by layer: nothing gathered whole"
    split = {**autocast, "sequence_parallel_size": 2}
    assert sampling(split, 1000, 2) == (0, (cache + scores) // 2), "a rank of 2 sharing the sequences samples half"
    ds, _ = on_a_gpu(8)
    plan = planner.plans(planner.workload(grpo, 128), {"autocast": ds}, 1, sampling=planner.sampling_of(grpo, 128))
    assert plan["autocast"].sampling[1] == cache + scores


def test_under_sequence_parallelism_a_rank_measures_its_part_of_each_sequence():
    """At sequence parallel N a rank's inputs are T/N tokens of each sequence: its activations are those of a plain
    run at T/N tokens, far fewer than at T; the model states are as many ranks' as before (tiling, which "auto"
    turns on under SP, apart: the next test)."""
    task = resolver.build(dataclasses.replace(SETTINGS, tiled="off"))
    inputs = planner.workload(task, 128, sequence=4)[1]
    assert inputs(2)[0][0].shape == (2, 32)
    ds, _ = on_a_gpu(8, DEFAULT_DS_CONFIG.parent / "zero2.json")
    sharded, short, whole = (planner.plans(planner.workload(task, seq, sequence=degree), {"zero2": ds}, 4)["zero2"]
                             for seq, degree in ((128, 4), (32, 1), (128, 1)))
    assert (sharded.per_sample, sharded.fixed, sharded.least) == (short.per_sample, short.fixed, short.least)
    assert sharded.per_sample < whole.per_sample / 3
    assert sharded.device == whole.device and sharded.host == whole.host


def test_the_plan_measures_a_tiled_model_as_the_run_tiles_it():
    """--tiled: the MLPs and the output layer by tiles hold less for the backward pass than whole at a sequence of
    8 hidden widths; auto tiles under sequence parallelism only."""
    ds, _ = on_a_gpu(8, DEFAULT_DS_CONFIG.parent / "zero2.json")
    per_sample = {}
    for choice, degree in (("off", 1), ("on", 1), ("auto", 1), ("auto", 2)):
        task = resolver.build(dataclasses.replace(SETTINGS, model="llama-tiny-long", tiled=choice))
        work = planner.workload(task, 2048 * degree, sequence=degree)
        per_sample[choice, degree] = planner.plans(work, {"zero2": ds}, 2)["zero2"].per_sample
        assert task.fused_logits == (choice == "on" or degree > 1)
    assert per_sample["on", 1] < 0.8 * per_sample["off", 1], per_sample
    assert per_sample["auto", 1] == per_sample["off", 1] and per_sample["auto", 2] == per_sample["on", 1]


@pytest.mark.parametrize("settings, sequence, message", [
    (SETTINGS, 3, "sequence parallel 3 does not divide a sample's 128 tokens: take a sequence length that 3 divides"),
    (Settings(model="gpt2-tiny"), 3, "a sample's 128 tokens"),  # the model's positions: the length a run takes
    (Settings(model="cnn"), 2, "sequence parallelism shards text sequences; cnn is an image model"),
])
def test_a_sequence_parallel_split_that_cannot_be_even_is_one_line(settings, sequence, message):
    with pytest.raises(UserError) as caught:
        planner.workload(resolver.build(settings), settings.block_size, sequence=sequence)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_sequence_parallel_run_is_weighed_at_its_part_of_each_sequence_over_every_rank():
    """2 replicas of 2 sequence-parallel ranks: a rank holds half of each sequence's activations, and ZeRO-1
    partitions over all 4 ranks. On a GPU where only that plan's bf16 weights fit, the run takes them; whole
    sequences, or a partition over the 2 replicas alone, would fit neither and keep autocast."""
    ds, note = on_a_gpu(64, DEFAULT_DS_CONFIG.parent / "zero1.json")
    task = resolver.build(SETTINGS)

    def peak(seq: int, ranks: int, bf16: bool = True) -> int:
        named = {"plan": planner.with_bf16_weights(ds) if bf16 else ds}
        return planner.plans(planner.workload(task, seq), named, ranks)["plan"].peak(64)
    bf16, autocast, whole, two = peak(64, 4), peak(64, 4, bf16=False), peak(128, 4), peak(64, 2)
    assert bf16 < min(autocast, whole, two)
    memory = int((bf16 + min(autocast, whole, two)) / 2 / estimate.USABLE)
    weighed, said = planner.weigh(ds, note, task, SETTINGS, 2, memory, 2)
    assert weighed["bf16"] == {"enabled": True}, said
    assert planner.weigh(ds, note, task, SETTINGS, 4, memory) == (ds, note), "whole sequences on 4 replicas"
    assert planner.weigh(ds, note, task, SETTINGS, 2, memory) == (ds, note), "2 replicas without sequence parallel"


def test_a_run_whose_machine_cannot_hold_what_its_ranks_offload_is_refused_its_reference_counted():
    """gpt2-7b's preference tuning under zero3_offload: the policy's 24 bytes a parameter on the host (weights,
    gradients, masters, moments) and the frozen reference's fp32 weights, 4 more, for each of 8 ranks of a machine:
    more than any machine here holds. Without offload nothing is weighed on a CPU."""
    import socket
    from types import SimpleNamespace
    import torch
    settings = Settings(model="gpt2-7b", task="preference", block_size=64, deepspeed_config="zero3_offload.json")
    task = resolver.build(settings)
    assert task.reference_kind == "frozen copy"
    ds = load_ds_config(DEFAULT_DS_CONFIG.parent / "zero3_offload.json")
    ranks = SimpleNamespace(split=None, tensor=1, replicas=1, sequence=1)
    world = SimpleNamespace(device=torch.device("cpu"), local_world_size=8)
    with pytest.raises(UserError) as refused:
        planner.weighed_for_run(ds, "", task, settings, ranks, world)
    parameters = sum(planner.parameters_of(planner.workload(task, 64)[0])[0])
    assert f"zero3_offload.json offloads {28 * parameters / 1e9:,.1f} GB a rank to the host" in str(refused.value)
    assert f"{8 * 28 * parameters / 1e9:,.1f} GB for the 8 rank(s) on {socket.gethostname()}" in str(refused.value)
    plain = load_ds_config(DEFAULT_DS_CONFIG.parent / "zero3.json")
    assert planner.weighed_for_run(plain, "note", task, settings, ranks, world) == (plain, "note")


def test_an_image_model_is_weighed_with_the_classes_and_channels_of_the_runs_data():
    """resnet18 on 10 classes of 32-pixel colour images: the plan's model is the run's, 1000 classes without data
    (the plan tool, which has none)."""
    from app.core.tasks import ImageClassification
    from app.data import Data, DataInfo
    settings = Settings(model="resnet18")
    info = DataInfo(10, 3, 32)
    task = ImageClassification(settings, Data(None, None, info))
    build, inputs, _, _ = planner.workload(task)
    run_model = task.build_model(info, {})
    assert sum(planner.parameters_of(build)[0]) == sum(p.numel() for p in run_model.parameters()) == 11_181_642
    assert inputs(2)[0][0].shape == (2, 3, 32, 32)
    assert sum(planner.parameters_of(planner.workload(resolver.build(settings))[0])[0]) == 11_689_512


def test_the_micro_batch_a_run_takes_is_the_files_else_derived_else_the_searchs():
    """As written; a global batch alone (DeepSpeedExamples' GAN file: 64 on 2 ranks) is split as DeepSpeed splits it;
    "auto" is the search's pick: the largest divisor of a replica's share that fits, 32 a replica by default."""
    assert planner.micro_of({"train_micro_batch_size_per_gpu": 4, "train_batch_size": 64}, 2, 100) == (4, False)
    assert planner.micro_of({"train_batch_size": 64}, 2, 100) == (32, False)
    assert planner.micro_of({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 2, 1) == (8, False)
    auto = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"}
    assert planner.micro_of(auto, 2, 2649) == (32, True) and planner.micro_of(auto, 2, 20) == (16, True)
    assert planner.micro_of({**auto, "train_batch_size": 48}, 2, 20) == (12, True)
    assert planner.micro_of({"train_micro_batch_size_per_gpu": "auto"}, 1, 0) == (0, True)


def test_a_model_that_cannot_train_on_one_sample_is_planned_from_two():
    """resnet18 on 32-pixel images ends in a 1x1 map whose BatchNorm needs two samples (the run's step fails on one):
    the plan measures 2 and 4 samples, takes 2 samples' peak as its least, and never picks a micro batch of 1."""
    from app.core.tasks import ImageClassification
    from app.data import Data, DataInfo
    task = ImageClassification(Settings(model="resnet18"), Data(None, None, DataInfo(10, 3, 32)))
    work = planner.workload(task)
    build, inputs, loss, _ = work
    with pytest.raises(ValueError, match="value per channel"):
        activation_count.activation_bytes(build, inputs, loss, 1, None, False)
    plan_ds = load_ds_config(DEFAULT_DS_CONFIG.parent / "zero1.json")
    plan = planner.plans(work, {"zero1": plan_ds}, 1)["zero1"]
    two = activation_count.activation_bytes(build, inputs, loss, 2, None, False)
    assert plan.least == plan.fixed + 2 * plan.per_sample == two and plan.per_sample > 0
    assert plan.peak(1) == plan.peak(2) and plan.smallest == 2
    larger = ImageClassification(Settings(model="resnet18"), Data(None, None, DataInfo(10, 3, 64)))  # a 2x2 map
    assert planner.plans(planner.workload(larger), {"zero1": plan_ds}, 1)["zero1"].smallest == 1
    edge = plan.peak(2) / estimate.USABLE  # the GPU memory in which a run may use just 2 samples' peak
    assert plan.largest_micro(edge - 1) == 0, "one sample less than 2's peak: none, not 1"
    fits = plan.largest_micro(edge + 1)  # 2, or more where the step's gradients, not 2 samples, make the peak
    assert fits >= 2 and plan.peak(fits) <= estimate.USABLE * (edge + 1) < plan.peak(fits + 1)


def test_the_host_check_counts_the_accumulation_that_zero2_offload_holds_gradients_for():
    """zero2_offload keeps on the host every gradient its partition touches once the accumulation is above 1: as
    many ranks on this machine as hold a rank's states without accumulation are refused once the micro batch search
    has set 4 accumulation steps, not where no search ran (tests/e2e/test_errors.py: in a run)."""
    import math
    from types import SimpleNamespace
    import torch
    from app.memory import host
    settings = Settings(model="gpt2-tiny", block_size=64, deepspeed_config="zero2_offload.json")
    task = resolver.build(settings)
    ds = load_ds_config(DEFAULT_DS_CONFIG.parent / "zero2_offload.json")
    ranks = SimpleNamespace(split=None, tensor=1, replicas=2, sequence=1)
    accumulated = {**ds, "gradient_accumulation_steps": 4}
    once, each = (planner._offloaded_here(d, task, settings, ranks)[0] for d in (ds, accumulated))
    here = math.floor(host.USABLE_HOST * host.host_memory() / once)
    assert each > once * (1 + 1 / here), "the touched gradients, whole: 4 bytes a parameter of half the model"
    world = SimpleNamespace(device=torch.device("cpu"), local_world_size=here)
    planner.held_by_host(ds, task, settings, ranks, world)
    planner.held_after_search(accumulated, accumulated, task, settings, ranks, world)  # no search: checked before
    with pytest.raises(UserError, match=f"for the {here} rank"):
        planner.held_after_search(ds, accumulated, task, settings, ranks, world)


@pytest.mark.parametrize("zero, runs", [
    ({"stage": 3}, True), ({"stage": 3, "memory_efficient_linear": True}, True),
    ({"stage": 3, "memory_efficient_linear": False}, False), ({"stage": 2}, False), (None, False),
])
def test_only_zero3_runs_deepspeeds_linear_unless_the_config_turns_it_off(zero, runs):
    assert planner.runs_deepspeed_linear({"zero_optimization": zero} if zero else {}) is runs
