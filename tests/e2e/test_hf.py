"""Transformers models end to end: a tiny GPT-2 under every ds_config on two ranks, a classifier, export, reload."""
import json
import math
import sys
import time

import pytest
import torch

from conftest import (REPO, assert_one_error_line, config_variant, main_each, read_metrics, read_summary, run,
                      spawn_ranks, train, write_text_rows)


# each config trains on the corpus written in another format, so every format is trained on too
LM_CONFIGS = {"dp": ".txt", "zero1": ".json", "zero2": ".jsonl", "zero3": ".csv", "zero2_offload": ".parquet",
              "zero3_offload": ".txt", "bf16": ".jsonl"}
LM_ARGS = ["--model", "gpt2-tiny", "--block_size", 32, "--max_steps", 6, "--log_interval", 1, "--eval_interval", 3]
CLASSIFIER_ARGS = ["--model", "bert-tiny", "--max_steps", 30, "--eval_interval", 30, "--log_interval", 10]


def _train_each(rank, world, jobs, report):
    """On every rank: train.run each job in one process group (no launcher start-up per job).

    First, rank 0 reports how much of gpt2-tiny each rank holds when it is built under ZeRO-3.
    """
    from app import train
    from app import settings as config
    from app.distributed import dist
    from app.ds import config as ds_config
    from app.distributed import launch
    from app.core import models
    from app.data import DataInfo
    from app.data.tokenizers import byte_tokenizer
    launch.prepare_environment()
    parsed = [config.parse([str(a) for a in argv]) for argv in jobs]
    zero3 = ds_config.load_ds_config(REPO / "ds_configs" / "zero3.json")  # before the group, as the app does
    group = launch.setup(timeout_s=300)
    zero3 = ds_config.resolve_batch_sizes(zero3, world, "zero3")
    model = models.build_hf(models.hf_spec("gpt2-tiny"), DataInfo(0, task="causal_lm"), byte_tokenizer(), zero3)
    held = [p.numel() for p in model.parameters()]
    if rank == 0:
        report.write_text(json.dumps({"held": sum(held), "full": sum(p.ds_numel for p in model.parameters())}))
    for settings, ds in parsed:
        assert train.run(settings, ds, group, time.perf_counter()) == 0
    dist.teardown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Output folders of the two-rank runs: one language model per ds_config, and the classifier."""
    root = tmp_path_factory.mktemp("hf")
    jobs = []
    for name, suffix in LM_CONFIGS.items():
        corpus = write_text_rows(root / f"corpus-{name}{suffix}", 300, seed=1)
        # a CPU without bf16 instructions multiplies bf16 matrices about 70x slower than fp32 ones: micro batch 1
        ds = config_variant(root, name, train_micro_batch_size_per_gpu=1 if name == "bf16" else 4)
        jobs.append(["--deepspeed_config", ds, "--dataset", corpus, *LM_ARGS, "--output_dir", root / name])
    labelled = write_text_rows(root / "labelled.csv", 600, seed=2, labelled=True)
    jobs.append(["--deepspeed_config", config_variant(root, "zero2", train_micro_batch_size_per_gpu=16),
                 "--dataset", labelled, *CLASSIFIER_ARGS, "--output_dir", root / "classifier"])
    spawn_ranks(2, _train_each, jobs, root / "zero3-build.json")
    return root


def test_zero3_partitions_the_model_as_it_is_built(runs):
    """Under ZeRO-3 no rank ever holds the whole model: each parameter is split as it is created."""
    built = json.loads((runs / "zero3-build.json").read_text())
    assert built["full"] == 5_289_472  # gpt2-tiny
    assert built["held"] == 0  # outside a forward pass a rank keeps only its partition (in ds_tensor)


@pytest.mark.parametrize("name", LM_CONFIGS)
def test_tiny_gpt2_trains_under_every_config(name, runs):
    rows, evals = read_metrics(runs / name)
    assert [r["step"] for r in rows] == list(range(1, 7)) and [e["step"] for e in evals] == [3, 6]
    assert abs(rows[0]["loss"] - math.log(8192)) < 0.5  # a fresh model guesses among its 8,192 tokens
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"] < rows[0]["loss"]
    for e in evals:
        assert e["eval_perplexity"] == pytest.approx(math.exp(e["eval_loss"]), rel=1e-6)
    summary = read_summary(runs / name)
    assert summary["task"] == "causal_lm" and summary["world_size"] == 2
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 32)
    assert 0 < summary["mfu"] < 1
    saved = runs / name / "checkpoints" / "step00000006"
    assert {p.name for p in (saved / "hf").iterdir()} >= {"config.json", "tokenizer.json"}


def test_tiny_classifier_learns_the_rule(runs):
    _, evals = read_metrics(runs / "classifier")
    assert evals[-1]["eval_accuracy"] >= 0.9  # chance is about 0.6: 5 of the 8 animals are mammals
    assert read_summary(runs / "classifier")["task"] == "sequence_classification"
    saved = json.loads(next((runs / "classifier" / "checkpoints").glob("step*/hf/config.json")).read_text())
    assert saved["id2label"] == {"0": "0", "1": "1"}, "the data's classes name the head's rows for the export"


def _held_out_loss(model, runs, name) -> float:
    """The run's held-out loss recomputed outside the app: mean over blocks of the next-token cross entropy."""
    from app.checkpoint.save import STATE, TrainerState
    from app.data import text
    from transformers import AutoTokenizer
    state_file = runs / name / "checkpoints" / "step00000006" / STATE
    saved = TrainerState.from_json(state_file.read_text(), state_file)
    _, held = text.load_splits(saved.dataset, "", "", 0.1, seed=42)
    tokenizer = AutoTokenizer.from_pretrained(runs / name / "tokenizer")
    ids = torch.tensor(list(text.lm_blocks(held, tokenizer, "text", 32, "held-out")["input_ids"]))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:]).item()


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    """The zero3 run's last checkpoint exported in save_pretrained form, and as a flat safetensors file."""
    out = tmp_path_factory.mktemp("exported")
    folder = runs / "zero3" / "checkpoints" / "step00000006"
    for target in (out / "gpt2", out / "flat.safetensors"):
        result = run([sys.executable, "-m", "app.tools.export", folder, target])
        assert result.returncode == 0, result.stderr
    return out


def test_save_pretrained_export_loads_offline_with_the_run_weights(runs, exported):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(exported / "gpt2").eval()
    flat = {k.removeprefix("hf."): v for k, v in load_file(exported / "flat.safetensors").items()}
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, flat[name]), name
    _, evals = read_metrics(runs / "zero3")
    assert _held_out_loss(model, runs, "zero3") == pytest.approx(evals[-1]["eval_loss"], abs=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(exported / "gpt2")
    assert tokenizer("the cat")["input_ids"] == AutoTokenizer.from_pretrained(runs / "zero3" / "tokenizer")(
        "the cat")["input_ids"]


def test_save_pretrained_folder_round_trips_through_model_flag(runs, exported, tmp_path):
    """Training --model <exported folder> starts from the trained weights and the folder's tokenizer."""
    out = tmp_path / "again"
    corpus = next(runs.glob("corpus-zero3.csv"))
    train("python", 1, "--model", exported / "gpt2", "--dataset", corpus, "--block_size", 32, "--max_steps", 2,
          "--log_interval", 1, "--deepspeed_config", config_variant(tmp_path, "dp", train_micro_batch_size_per_gpu=8),
          "--output_dir", out)
    rows, _ = read_metrics(out)
    _, before = read_metrics(runs / "zero3")
    assert abs(rows[0]["loss"] - before[-1]["eval_loss"]) < 0.1 and rows[0]["loss"] < math.log(8192) - 1
    assert (out / "tokenizer" / "tokenizer.json").read_text() == (exported / "gpt2" / "tokenizer.json").read_text()


def test_bad_text_inputs_get_one_line_and_exit_2(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    corpus = write_text_rows(tmp_path / "corpus.txt", 100)
    (tmp_path / "empty.txt").write_text("")
    small = tmp_path / "small-vocab"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=100)).save_pretrained(small)
    lm = ["--model", "gpt2-tiny", "--dataset", corpus, "--max_steps", 1]
    cases = {
        "missing column": ([*lm, "--text_column", "body"], "--text_column 'body' is not in the dataset; its columns are: text"),
        "empty dataset": (["--model", "gpt2-tiny", "--dataset", tmp_path / "empty.txt"], "has no training rows"),
        "block too long": ([*lm, "--block_size", 4096], "--block_size 4096 is longer than gpt2-tiny's 128 positions"),
        "vocabulary": (["--model", small, "--dataset", corpus], "the tokenizer has 258 tokens but"),
        "unknown task": ([*lm, "--task", "translation"], "--task 'translation' is not one of auto, causal_lm"),
        "image data": (["--model", "gpt2-tiny"], "trains on text, not digits"),
        "image model on text": (["--dataset", corpus], "text needs a transformers model"),
    }
    results = main_each([[*argv, "--output_dir", tmp_path / name.replace(" ", "-")] for name, (argv, _) in cases.items()])
    for (name, (_, expected)), (code, err) in zip(cases.items(), results):
        assert code == 2, name
        assert assert_one_error_line(err, expected) == err.strip().splitlines()[-1], (name, err)
        assert not (tmp_path / name.replace(" ", "-") / "metrics.csv").exists()
