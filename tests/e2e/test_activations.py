"""Activation checkpointing on 2 ranks: per-step losses with and without it agree, for the CNN under every ZeRO
stage and for ResNet-18 and the tiny GPT-2 under ZeRO-3. What it recomputes, in one process:
tests/unit/test_activations.py."""
import pytest

from conftest import config_variant, read_metrics, train_jobs, write_text_rows

STAGES = ("dp", "zero1", "zero2", "zero3")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(name, stage, checkpointed) -> (per-step losses, output) of 2 ranks, one after another in one launch."""
    tmp = tmp_path_factory.mktemp("activations")
    corpus = write_text_rows(tmp / "corpus.txt", 300)
    models_ = {"cnn": ["--max_steps", 6], "resnet18": ["--dataset", "synthetic", "--max_steps", 3],
               "gpt2-tiny": ["--dataset", corpus, "--block_size", 32, "--max_steps", 4]}
    cases = [(model, stage, on) for model in models_ for stage in (STAGES if model == "cnn" else ("zero3",))
             for on in (False, True)]
    jobs = []
    for model, stage, on in cases:
        config = config_variant(tmp, stage, **({"activation_checkpointing": {}} if on else {}))
        config = config.rename(tmp / f"{model}-{stage}-{on}.json")
        jobs.append(["--deepspeed_config", config, "--model", model, *models_[model], "--log_interval", 1,
                     "--output_dir", tmp / f"{model}-{stage}-{on}"])
    outputs = train_jobs("ranks", 2, jobs)
    return {case: ([r["loss"] for r in read_metrics(tmp / f"{case[0]}-{case[1]}-{case[2]}")[0]], output)
            for case, output in zip(cases, outputs)}


@pytest.mark.parametrize("model, stage", [("cnn", s) for s in STAGES] + [("resnet18", "zero3"), ("gpt2-tiny", "zero3")])
def test_checkpointed_runs_give_the_losses_of_plain_ones(model, stage, runs):
    """fp32, 2 ranks: per-step losses with and without activation checkpointing agree within 1e-6."""
    plain, _ = runs[(model, stage, False)]
    checkpointed, output = runs[(model, stage, True)]
    assert "activation checkpointing: " in output and "recompute their activations" in output
    assert len(plain) == len(checkpointed) > 1
    assert max(abs(a - b) for a, b in zip(plain, checkpointed)) < 1e-6, list(zip(plain, checkpointed))
