"""The plan command (python -m app.tools.plan): memory sizes, its table, its recommendation and its one-line
mistakes. The estimate it prints: test_estimate.py."""
import json
import re

import pytest

from app.tools import plan as plan_tool

@pytest.mark.parametrize("text, count", [("80GB", 80e9), ("80GiB", 80 * 2**30), ("81920MiB", 80 * 2**30),
                                         ("24", 24e9), (" 1.5 TB ", 1.5e12)])
def test_memory_sizes(text, count):
    assert plan_tool.memory_size(text) == int(count)


@pytest.mark.parametrize("argv, message", [
    (["--gpu_memory", "lots"], "--gpu_memory 'lots' is not a memory size; write it like 80GB"),
    (["--gpu_memory", "0GB"], "is not a memory size"),
    ([], "no GPU here to read the memory of: pass --gpu_memory"),
    (["--gpu_memory", "8GB", "--model", "nope-9000"], "unknown model 'nope-9000'"),
    (["--gpu_memory", "8GB", "--reference", "precompute"], "--reference and --preference_loss plan preference "
                                                           "tuning: add --preference"),
    (["--gpu_memory", "8GB", "--preference"], "--task preference trains a transformers model on text; cnn is an "
                                              "image model"),
    (["--gpu_memory", "8GB", "--sequence_parallel", "0"], "--sequence_parallel 0: it counts ranks, 1 or more"),
    (["--gpu_memory", "8GB", "--world_size", "6", "--sequence_parallel", "4"], "--sequence_parallel 4 does not "
                                                                                 "divide --world_size 6"),
    (["--gpu_memory", "8GB", "--world_size", "4", "--sequence_parallel", "4", "--seq_len", "1022"],
     "--sequence_parallel 4 does not divide --seq_len 1022"),
    (["--gpu_memory", "8GB", "--world_size", "3", "--sequence_parallel", "3", "--model", "gpt2-tiny"],
     "sequence parallel 3 does not divide a sample's 128 tokens"),  # the length a run takes: the model's positions
    (["--gpu_memory", "8GB", "--world_size", "2", "--sequence_parallel", "2"], "sequence parallelism shards text "
                                                                               "sequences; cnn is an image model"),
    (["--gpu_memory", "8GB", "--num_generations", "4"], "--num_generations, --beta and --gather_for_generation plan "
                                                        "online RL: add --grpo"),
    (["--gpu_memory", "8GB", "--host_memory", "lots"], "--host_memory 'lots' is not a memory size"),
    (["--gpu_memory", "8GB", "--world_size", "2", "--ranks_per_node", "4"], "--ranks_per_node 4 is more than "
                                                                              "--world_size 2"),
    (["--gpu_memory", "8GB", "--grpo", "--preference"], "--grpo and --preference plan two kinds of training"),
    (["--gpu_memory", "8GB", "--grpo"], "--task grpo trains a transformers model on text; cnn is an image model"),
    (["--gpu_memory", "8GB", "--grpo", "--model", "gpt2-tiny", "--num_generations", "1"],
     "--num_generations must be at least 2"),
])
def test_mistakes_are_one_line(argv, message, capsys):
    assert plan_tool.main(argv) == 2  # the CPU tests see no GPU (conftest hides them)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_a_config_only_folder_plans_and_the_fastest_config_that_fits_is_recommended(tmp_path, capsys):
    """Eager (--compile off), dp's activations do not fit where checkpointed ones do; the compiled step keeps
    fewer, and dp fits (--compile's default, as a run on a GPU compiles)."""
    from app.core import models
    models.hf_spec("gpt2-tiny").config.save_pretrained(tmp_path / "gpt2")  # config.json, no weights
    argv = ["--model", str(tmp_path / "gpt2"), "--world_size", "2", "--micro_batch", "64", "--seq_len", "128",
            "--gpu_memory", "1.4GB"]
    assert plan_tool.main([*argv, "--compile", "off"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line.split()[0] in plan_tool.ORDER}
    assert list(rows) == list(plan_tool.ORDER), "every shipped data-parallel config, fastest first"
    assert rows["dp"][-3] == "no" and rows["activation_checkpointing"][-3] == "yes", out
    assert "recommended: activation_checkpointing" in out and "dp would peak at" in out
    assert "dp+bf16 would peak at" in out and "not planned: bf16" in out
    assert "act/sample: the eager step's" in out and "compiled step's" not in out
    assert plan_tool.main(argv) == 0
    out = capsys.readouterr().out
    compiled = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line.split()[0] in rows}
    assert compiled["dp"][-3] == "yes" and "recommended: dp," in out, out
    assert int(compiled["dp"][-2]) > 2 * int(rows["dp"][-2]), "the largest micro batch: compiled keeps far less"
    assert compiled["activation_checkpointing"][-2] == rows["activation_checkpointing"][-2]  # counted eager
    assert "act/sample: the compiled step's" in out and "act/sample: the eager step's" in out


def test_a_row_plans_the_micro_batch_the_run_takes_not_the_largest_that_fits(tmp_path, capsys):
    """A file with a global batch alone runs 64 / 2 ranks = 32 a micro batch; one with "auto" micro and global
    batches searches a replica's share of 32: neither is the thousands of samples an 80 GB GPU would hold."""
    for name, ds, shown in (("global", {"train_batch_size": 64}, "32"),
                            ("auto", {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, "32*")):
        (tmp_path / f"{name}.json").write_text(json.dumps({**ds, "zero_optimization": {"stage": 3}}))
        assert plan_tool.main(["--model", "gpt2-tiny", "--world_size", "2", "--gpu_memory", "80GB",
                               "--deepspeed_config", str(tmp_path / f"{name}.json")]) == 0
        out = capsys.readouterr().out
        row = out.splitlines()[2].split()
        assert row[-5] == shown and int(row[-2]) > 1000, out
        assert ("* the micro batch is \"auto\"" in out) == shown.endswith("*")


def test_a_global_batch_over_the_micro_batch_and_ranks_is_planned_as_the_accumulation_it_makes(tmp_path):
    """64 samples in micro batches of 4 on 2 ranks: DeepSpeed accumulates 8, and a ZeRO-0 step holds its gradients
    through the next forward, as with the accumulation written out; with none, the peak is lower."""
    peaks = []
    for name, batch in (("global", {"train_batch_size": 64}), ("written", {"gradient_accumulation_steps": 8}),
                        ("none", {"gradient_accumulation_steps": 1})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**batch, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0}}))
        args = plan_tool.parse(["--model", "gpt2-tiny", "--world_size", "2", "--gpu_memory", "80GB",
                                "--deepspeed_config", str(path)])
        planned = plan_tool.measure(args, plan_tool.configs(args), plan_tool.task_of(args))
        peaks.append(planned[str(path)].peak(4))
    assert peaks[0] == peaks[1] > peaks[2], peaks


def test_a_micro_batch_too_few_for_a_batchnorm_model_does_not_fit_and_says_why(capsys):
    """resnet18 on 32-pixel images trains on no fewer than 2 samples a micro batch: at 1 no row fits, however much
    memory, and the recommendation says to raise it rather than lower it."""
    argv = ["--model", "resnet18", "--image_size", "32", "--gpu_memory", "80GB", "--deepspeed_config",
            str(plan_tool.ds_config.REPO / "ds_configs" / "dp.json")]
    assert plan_tool.main([*argv, "--micro_batch", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[2:4]]
    assert [row[-5:-2] for row in rows] == [["1", "-", "no"]] * 2, out
    assert "recommended: none trains this micro batch: the model trains on no fewer than 2 samples a micro batch " \
           "(BatchNorm over a 1x1 map of one sample); raise the micro batch" in out
    assert plan_tool.main([*argv, "--micro_batch", "2"]) == 0
    assert "recommended: ds_configs/dp.json, peaking at" in capsys.readouterr().out.replace(
        str(plan_tool.ds_config.REPO) + "/", "")


def test_each_autocast_config_is_also_planned_with_bf16_weights_which_win_where_only_they_fit(tmp_path, capsys):
    """bf16 weights hold half the weights and gradients of autocast's fp32 ones: on a GPU where dp under autocast
    does not fit and dp with bf16 weights does, the plan recommends that (autocast first at the same config)."""
    from app.core import models
    models.hf_spec("gpt2-tiny").config.save_pretrained(tmp_path / "gpt2")
    argv = ["--model", str(tmp_path / "gpt2"), "--world_size", "2", "--micro_batch", "64", "--seq_len", "128",
            "--deepspeed_config", str(plan_tool.ds_config.REPO / "ds_configs" / "dp.json")]
    assert plan_tool.main([*argv, "--gpu_memory", "10GB"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:4]}
    config = argv[argv.index("--deepspeed_config") + 1]
    autocast, bf16 = rows[config], rows[config + "+bf16"]
    assert float(bf16[1]) == pytest.approx(float(autocast[1]) / 2, abs=0.01), "weights: 2 bytes, not 4"
    peaks = float(autocast[9]), float(bf16[9])
    assert peaks[1] < peaks[0] and f"recommended: {config}," in out, "both fit: autocast, the more precise"
    memory = sum(peaks) / 2 / 0.92  # a run may use 92% of it: between the two peaks
    assert plan_tool.main([*argv, "--gpu_memory", f"{memory:.4f}GB"]) == 0
    out = capsys.readouterr().out
    assert f"recommended: {config}+bf16" in out and "with bf16 weights in place of autocast's fp32 ones" in out
    assert f"({config} would peak at" in out


PLANNED = ("dp", "dp+bf16", "zero2", "zero3", "zero3_offload")


def command_plans(folder, *flags, world_size=4, only=PLANNED, compile="off") -> dict:
    """{config: MemoryPlan} of gpt2-tiny's shape at 128 tokens (unless flags say --seq_len), as the command plans
    them with these flags; eager, unless compile says otherwise (a task that trains eager is counted so anyway)."""
    args = plan_tool.parse(["--model", str(folder), "--world_size", str(world_size), "--seq_len", "128",
                            "--gpu_memory", "10GB", "--compile", compile, *flags])
    named = {name: ds for name, ds in plan_tool.configs(args).items() if name in only}
    return plan_tool.measure(args, named, plan_tool.task_of(args))


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    from app.core import models
    folder = tmp_path_factory.mktemp("plan") / "gpt2"
    models.hf_spec("gpt2-tiny").config.save_pretrained(folder)  # config.json, no weights
    return folder


def test_a_preference_plan_counts_two_sequences_a_pair_and_the_frozen_copys_weights(gpt2_folder):
    """A sample is a pair: twice the activations of a plain run's sample at the same length. The frozen copy holds
    the policy's weights as its engine does: fp32 under autocast, bf16 with the bf16 section, whole on every rank
    under ZeRO 0-2, a quarter each on 4 ranks under ZeRO-3, on the host with parameter offload; no gradient,
    optimizer state nor master of its own."""
    from app.core import models
    plain, pairs = command_plans(gpt2_folder), command_plans(gpt2_folder, "--preference")
    total, shape = plain["dp"].parameters, models.hf_spec("gpt2-tiny").config
    for name in PLANNED:
        # the answers' log-probabilities and the next-token loss differ in their own small tensors: measured 0.09%
        # less a sample, and up to 0.2% (dp: 18 KB) less a micro batch. Under ZeRO-3 DeepSpeed's linear keeps the
        # output layer's fp32 weight for the backward, so its bf16 cast lives through the forward only: a pair's
        # step, which peaks as its backward starts, holds it no longer
        cast = 2 * shape.vocab_size * shape.n_embd if name.startswith("zero3") else 0
        assert pairs[name].per_sample == pytest.approx(2 * plain[name].per_sample, rel=2e-3), name
        assert pairs[name].fixed == pytest.approx(plain[name].fixed - cast, rel=3e-3, abs=64), name
        assert "reference" not in plain[name].device and "reference" not in plain[name].host
        extra = {k: v for k, v in pairs[name].device.items() if k != "reference"}
        assert extra == plain[name].device, "the policy's own states do not change"
        # 8 pairs peak as 16 plain samples do, and the copy beside them
        assert pairs[name].peak(8) == pytest.approx(plain[name].peak(16) + pairs[name].device["reference"] - cast,
                                                    rel=1e-3)
    assert pairs["dp"].device["reference"] == 4 * total and pairs["zero2"].device["reference"] == 4 * total
    assert pairs["dp+bf16"].device["reference"] == 2 * total
    assert pairs["zero3"].device["reference"] == pytest.approx(4 * total / 4, rel=1e-4), "a quarter on each of 4 ranks"
    offloaded = pairs["zero3_offload"]
    assert offloaded.device["reference"] == 0 and offloaded.host["reference"] == pairs["zero3"].device["reference"]


def test_a_compiled_plan_counts_a_pair_as_two_sequences_and_lora_through_the_frozen_base(gpt2_folder):
    """Compiled (the default), the graph a pair's step traces keeps twice what a plain sample's does, as eager; LoRA
    traces too (its base frozen); preference tuning's LoRA reference under ZeRO-3 trains eager, and is counted so."""
    plain = command_plans(gpt2_folder, compile="auto", only=("dp", "zero3"))
    pairs = command_plans(gpt2_folder, "--preference", compile="auto", only=("dp",))
    assert plain["dp"].counted == pairs["dp"].counted == "compiled"
    assert pairs["dp"].per_sample == pytest.approx(2 * plain["dp"].per_sample, rel=0.02)
    eager = command_plans(gpt2_folder, only=("dp",))
    assert plain["dp"].per_sample < eager["dp"].per_sample / 2, "the compiled step keeps less than half"
    lora = command_plans(gpt2_folder, "--lora", compile="auto", only=("zero3",))
    assert lora["zero3"].counted == "compiled" and 0 < lora["zero3"].per_sample < eager["dp"].per_sample
    reference = command_plans(gpt2_folder, "--preference", "--lora", compile="auto", only=("dp", "zero3"))
    assert (reference["dp"].counted, reference["zero3"].counted) == ("compiled", "eager")


@pytest.mark.parametrize("flags, same_as", [(["--lora"], ["--lora"]), (["--reference", "precompute"], []),
                                            (["--preference_loss", "simpo"], [])])
def test_no_reference_bytes_under_lora_precomputed_or_simpo(gpt2_folder, flags, same_as):
    """The policy with its adapters off, log-probabilities computed before training and SimPO's loss hold no model
    of their own: the model states are the plain run's, and only the pairs double the activations."""
    pairs = command_plans(gpt2_folder, "--preference", *flags, only=("zero3", "zero3_offload"))
    plain = command_plans(gpt2_folder, *same_as, only=("zero3", "zero3_offload"))
    for name, found in pairs.items():
        assert "reference" not in found.device and "reference" not in found.host
        assert (found.device, found.host) == (plain[name].device, plain[name].host), name
        assert found.per_sample == pytest.approx(2 * plain[name].per_sample, rel=2e-3)


def test_the_table_says_which_reference_and_shows_its_column(gpt2_folder, capsys):
    dp = str(plan_tool.ds_config.REPO / "ds_configs" / "dp.json")
    argv = ["--model", str(gpt2_folder), "--world_size", "2", "--micro_batch", "4", "--seq_len", "128",
            "--gpu_memory", "10GB", "--deepspeed_config", dp, "--preference"]
    assert plan_tool.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("preference pairs: act/sample is a pair's two sequences; reference: frozen copy, its "
                               "weights per rank in the ref column"), lines[1]
    header, row = lines[2].split(), lines[3].split()
    assert header[5:8] == ["working", "ref", "host"] and row[0] == dp and row[6] == row[1], "the copy: fp32 weights"
    assert plan_tool.main([*argv, "--lora"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "reference: adapters off, the model itself with its LoRA adapters off: no memory of its own" in lines[1]
    assert lines[3].split()[6] == "-"


def test_a_long_config_path_keeps_the_rows_columns_under_their_names(gpt2_folder, tmp_path, capsys):
    long = tmp_path / "a-folder-whose-name-is-longer-than-the-column" / "zero3.json"
    long.parent.mkdir()
    long.write_text((plan_tool.ds_config.REPO / "ds_configs" / "zero3.json").read_text())
    argv = ["--model", str(gpt2_folder), "--micro_batch", "4", "--seq_len", "128", "--gpu_memory", "10GB",
            "--deepspeed_config", str(long), "--preference"]
    assert plan_tool.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("config"))
    row = next(line for line in lines if line.startswith(str(long)))
    ends = [[m.end() for m in re.finditer(r"\S+", line)][1:] for line in (header, row)]
    assert len(ends[1]) == 13 and ends[0][:12] + ends[0][-1:] == ends[1], f"{header}\n{row}"  # "DS est." two


def test_at_sequence_parallel_n_a_rank_holds_the_activations_of_seq_over_n_tokens(gpt2_folder):
    """4 ranks sharing each 128-token sequence: each sample's activations per rank are a plain run's at 32 tokens,
    while ZeRO partitions the model states over all 4 ranks, as a plain run on 4 ranks does (tiling, which --tiled
    auto turns on under SP, apart: tests/unit/test_planner.py)."""
    sharded = command_plans(gpt2_folder, "--sequence_parallel", "4", "--tiled", "off")
    short, whole = command_plans(gpt2_folder, "--seq_len", "32"), command_plans(gpt2_folder)
    one_rank = command_plans(gpt2_folder, "--seq_len", "32", world_size=1, only=("zero3",))
    for name in PLANNED:
        assert sharded[name].per_sample == short[name].per_sample, name
        assert (sharded[name].fixed, sharded[name].least) == (short[name].fixed, short[name].least), name
        assert sharded[name].per_sample < whole[name].per_sample / 3, name
        assert (sharded[name].device, sharded[name].host) == (whole[name].device, whole[name].host), name
    partitioned = [sum(plan.device[k] for k in ("weights", "gradients", "optimizer")) for plan in
                   (sharded["zero3"], one_rank["zero3"])]
    assert partitioned[0] * 4 == partitioned[1], "partitioned over 4 ranks, not 1 replica"


def test_a_config_that_splits_sequences_is_planned_as_it_splits_them(capsys):
    """--deepspeed_config ds_configs/sequence_parallel.json plans 2 ranks sharing each sequence, as a run of it does."""
    config = str(plan_tool.ds_config.REPO / "ds_configs" / "sequence_parallel.json")
    argv = ["--model", "llama-tiny", "--seq_len", "128", "--micro_batch", "1", "--gpu_memory", "80GB",
            "--world_size", "2", "--deepspeed_config", config]
    assert plan_tool.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("sequence parallel: seq 128 over 2 ranks: 64 tokens")


def test_the_table_says_how_the_sequence_is_split_and_a_length_past_the_positions(capsys):
    """A Llama's rotary positions plan at any length (the preset, from its config: nothing downloaded); past the
    preset's 128 positions the plan says a run would refuse it."""
    dp = str(plan_tool.ds_config.REPO / "ds_configs" / "dp.json")
    argv = ["--model", "llama-tiny", "--seq_len", "4096", "--micro_batch", "1", "--gpu_memory", "80GB",
            "--deepspeed_config", dp, "--tiled", "off"]
    assert plan_tool.main([*argv, "--sequence_parallel", "4", "--world_size", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "; 8 ranks: 2 data-parallel replica(s) of 4; GPU 80.0 GB" in lines[0], lines[0]
    assert lines[1] == ("sequence parallel: seq 4096 over 4 ranks: 1024 tokens per rank, whose activations "
                        "act/sample counts; ZeRO 1-3 partition over all 8 ranks")
    assert lines[2].startswith("seq 4096 is longer than llama-tiny's 128 positions: train.py refuses a --block_size")
    sharded = lines[4].split()
    assert plan_tool.main([*argv[:3], "1024", *argv[4:], "--world_size", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "; 8 data-parallel rank(s); GPU" in lines[0] and not lines[1].startswith("sequence parallel")
    assert lines[3].split()[:8] == sharded[:8], "the same states and act/sample as 1024 tokens on 8 ranks"


def test_a_grpo_plan_counts_the_groups_sequences_and_their_sampling(gpt2_folder):
    """A sample is a prompt: its group's 4 sequences train together (four times a plain sample's activations), and
    sampling them first holds their key-value cache, with, under ZeRO-3 gathered whole, the weights the rank does
    not hold; with --beta above 0 the frozen copy rides along as in preference tuning."""
    plain = command_plans(gpt2_folder)
    grpo = command_plans(gpt2_folder, "--grpo", "--num_generations", "4")
    for name in PLANNED:
        assert grpo[name].per_sample == pytest.approx(4 * plain[name].per_sample, rel=1e-4), name
        assert grpo[name].sampling[1] > 0 and "reference" not in grpo[name].device
    whole = 4 * plain["zero3"].parameters
    assert grpo["dp"].sampling[0] == 0 and grpo["zero3"].sampling[0] == whole - whole // 4, "three quarters gathered"
    layered = command_plans(gpt2_folder, "--grpo", "--num_generations", "4", "--gather_for_generation", "off")
    assert layered["zero3"].sampling == (0, grpo["zero3"].sampling[1])
    held = command_plans(gpt2_folder, "--grpo", "--num_generations", "4", "--beta", "0.1")
    assert held["dp"].device["reference"] == 4 * plain["dp"].parameters


def test_a_machines_memory_must_hold_what_its_ranks_offload(gpt2_folder, capsys):
    """zero3_offload keeps 24 bytes a parameter on the host (fp32 weights, two gradients, masters, Adam's moments): where
    the machine's 4 ranks' share is more than its memory gives them, the row says host and nothing is recommended;
    with 2 ranks a machine it fits."""
    offload = plan_tool.ds_config.REPO / "ds_configs" / "zero3_offload.json"
    each = sum(command_plans(gpt2_folder, only=("zero3_offload",))["zero3_offload"].host.values())
    assert each == pytest.approx(24 * 5.3e6 / 4, rel=0.01)
    memory = 3 * each / 0.9  # 3 ranks' worth of what a machine may give them
    argv = ["--model", str(gpt2_folder), "--world_size", "4", "--seq_len", "128", "--micro_batch", "1",
            "--gpu_memory", "10GB", "--deepspeed_config", str(offload), "--host_memory", f"{memory:.0f}B"]
    assert plan_tool.main(argv) == 0
    out = capsys.readouterr().out
    assert f"host {memory / 1e9:,.1f} GB for 4 rank(s)" in out
    assert out.splitlines()[2].split()[-3] == "host", out
    assert f"recommended: none fits; the GPU would hold {offload}, but the host would not hold what it offloads" in out
    assert plan_tool.main([*argv, "--ranks_per_node", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].split()[-3] == "yes" and f"recommended: {offload}," in out, out


def test_the_recommendation_gives_each_faster_config_the_peak_of_its_row(gpt2_folder, capsys):
    """The configs' own micro batch (32): each faster config the recommendation passes over is said to peak where
    its row does."""
    assert plan_tool.main(["--model", str(gpt2_folder), "--world_size", "4", "--seq_len", "128", "--gpu_memory",
                           "0.75GB", "--compile", "off"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    rows = lines[2:next(i for i, line in enumerate(lines) if line.startswith("recommended: "))]
    peaks = {line.split()[0]: line.split()[-4] for line in rows}
    assert peaks["dp"] != "-" and rows[0].split()[-5] == "32", out
    said = out.split("recommended: ")[1].splitlines()[0].rsplit(" (", 1)[1].rstrip(")").split("; ")
    assert said and all(f"would peak at {peaks[part.split()[0]]}" in part for part in said), out


def test_an_image_model_is_planned_without_a_traceback_and_not_offered_lora(capsys):
    """cnn, the default model, whose +bf16 rows take bf16 images; under offload on a machine too small, the advice
    leaves out LoRA, which trains transformers models only. 64 ranks plan 8 on a machine without GPUs."""
    assert plan_tool.main(["--gpu_memory", "80GB", "--world_size", "64"]) == 0
    out = capsys.readouterr().out
    assert "for 8 rank(s)" in out.splitlines()[0] and "recommended: dp," in out, out
    offload = plan_tool.ds_config.REPO / "ds_configs" / "zero3_offload.json"
    assert plan_tool.main(["--model", "resnet18", "--gpu_memory", "80GB", "--world_size", "1", "--deepspeed_config",
                           str(offload), "--host_memory", "50MB"]) == 0
    out = capsys.readouterr().out
    assert "recommended: none fits; the GPU would hold" in out and "--lora" not in out, out
