"""Pipeline parallelism for real: pipelined runs (gloo, 2 and 3 CPU ranks) against one process, a wrong section
in one line, ResNet-18 exported to plain torchvision, GPT-2's tied embeddings and activation checkpointing."""
import pytest
import torch

from app.core import models
from app.parallel import pipeline
from app.data import DataInfo
from conftest import (assert_one_error_line, config_variant, main_each, read_metrics, read_summary, spawn_ranks,
                      train_jobs, write_text_rows)
from e2e.test_train import one_process_reference
from unit.test_pipeline import PIPE


def test_a_wrong_pipeline_config_ends_the_run_with_one_line(tmp_path):
    """Through train.main, before anything is built: ZeRO-2, a stage count the world size cannot hold, a typo."""
    cases = [config_variant(tmp_path, "zero2", pipeline={"stages": 1}),
             config_variant(tmp_path, "dp", pipeline={"stages": 2}),
             config_variant(tmp_path, "pipeline", pipeline={"stages": 1, "partion": "uniform"})]
    results = main_each([["--deepspeed_config", c, "--max_steps", 2, "--output_dir", tmp_path / f"r{i}"]
                         for i, c in enumerate(cases)])
    texts = ["cannot pipeline with ZeRO stage 2", "does not divide the world size 1", "did you mean 'partition'"]
    for (code, err), text in zip(results, texts):
        assert code == 2
        assert_one_error_line(err, text)
    assert not any((tmp_path / f"r{i}").exists() for i in range(3)), "nothing written"


def variant(root, tag: str, **changes):
    """ds_configs/pipeline.json with top-level keys changed, in its own folder under root."""
    (root / tag).mkdir()
    return config_variant(root / tag, "pipeline", **changes)


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """tag -> (output_dir, stdout) of the pipelined runs, one after another in one 2-rank launch."""
    root = tmp_path_factory.mktemp("pipelined")
    corpus = write_text_rows(root / "corpus.txt", 600)
    steps = ["--max_steps", 12, "--log_interval", 1]
    jobs = {
        "zero0": ["--deepspeed_config", variant(root, "zero0", train_micro_batch_size_per_gpu=8), *steps],
        "zero1": ["--deepspeed_config", variant(root, "zero1", train_micro_batch_size_per_gpu=8,
                                                zero_optimization={"stage": 1}), *steps],
    }
    for tag, interval in (("resnet18", 1), ("resnet18-plain", 0)):  # batch norms' statistics recomputed, or not
        jobs[tag] = ["--deepspeed_config", variant(root, tag, train_micro_batch_size_per_gpu=16, pipeline={
            "stages": 2, "partition": "type:BasicBlock", "activation_checkpoint_interval": interval}),
            "--model", "resnet18", "--dataset", "synthetic", "--max_steps", 4, "--log_interval", 1]
    # activations recomputed in the backward pass, 20 steps; or kept, for the first 10 (the warm-up's: the same lr)
    for tag, interval, max_steps in (("gpt2", 1, 20), ("gpt2-plain", 0, 10)):
        config = variant(root, tag, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=2,
                         pipeline={"stages": 2, "activation_checkpoint_interval": interval})
        jobs[tag] = ["--deepspeed_config", config, "--model", "gpt2-tiny", "--dataset", corpus, "--block_size", 32,
                     "--max_steps", max_steps, "--log_interval", 1, "--eval_interval", 10]
    outputs = train_jobs("ranks", 2, [[*args, "--output_dir", root / tag] for tag, args in jobs.items()])
    return {tag: (root / tag, out) for tag, out in zip(jobs, outputs)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per-step losses of plain data parallel in one process, micro batch 8 (the pipelines' global batch)."""
    return one_process_reference(tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("tag", ["zero0", "zero1"])
def test_two_stages_give_the_losses_of_one_process(tag, pipelined, reference):
    out, stdout = pipelined[tag]
    losses = [r["loss"] for r in read_metrics(out)[0]]
    assert len(losses) == len(reference) == 12 and losses[-1] < losses[0]
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 1e-5, list(zip(losses, reference))
    assert "pipeline: 2 stages x 1 data-parallel replica(s)" in stdout and stdout.count("mode: ") == 1
    summary = read_summary(out)
    assert summary["pipeline_stages"] == 2 and summary["zero_stage"] == (1 if tag == "zero1" else 0)
    assert summary["eval_accuracy"] > 0 and summary["eval_loss"] < losses[0]


def test_three_stages_on_three_ranks_give_the_losses_of_one_process(tmp_path, reference):
    config = config_variant(tmp_path, "pipeline", train_micro_batch_size_per_gpu=8,
                            pipeline={"stages": 3, "partition": "type:Conv2d|Linear"})
    out, = train_jobs("ranks", 3, [["--deepspeed_config", config, "--max_steps", 12, "--log_interval", 1,
                                        "--output_dir", tmp_path / "run"]])
    assert "pipeline: 3 stages x 1 data-parallel replica(s)" in out and "layers by stage 0: 0-5, 1: 6-7, 2: 8-8" in out
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")[0]]
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 1e-5, list(zip(losses, reference))


def test_resnet18_splits_trains_and_exports_to_plain_torchvision(pipelined, tmp_path):
    """The exported fp32 weights load into an unsplit torchvision ResNet-18 and give the pipeline's eval loss;
    checkpointing each layer changes neither the losses nor the batch norms' statistics (which the recomputation
    in the backward would update a second time), so the eval loss is the plain run's."""
    import torch.nn.functional as F
    import torchvision
    from safetensors.torch import load_file
    from app.data.images import build_image_sets
    from app.tools.export import export
    out, stdout = pipelined["resnet18"]
    assert "layers by stage" in stdout
    checkpoint = out / "checkpoints" / "step00000004"
    assert len(list(checkpoint.glob("layer_*-model_states.pt"))) == 15, "weights kept in per-layer files"
    export(checkpoint, tmp_path / "resnet18.safetensors")
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(load_file(tmp_path / "resnet18.safetensors"))  # strict: every tensor, no extra
    _, eval_set, _ = build_image_sets("synthetic", "data")
    images, labels = eval_set.tensors
    with torch.no_grad():
        loss = F.cross_entropy(model.eval()(images), labels).item()
    assert abs(loss - read_summary(out)["eval_loss"]) < 1e-4
    plain = pipelined["resnet18-plain"][0]
    assert [r["loss"] for r in read_metrics(out)[0]] == pytest.approx([r["loss"] for r in read_metrics(plain)[0]])
    assert read_summary(out)["eval_loss"] == pytest.approx(read_summary(plain)["eval_loss"], rel=1e-5)


def test_gpt2_pipeline_learns_and_checkpointing_activations_changes_nothing(pipelined):
    """2 micro batches per step through 2 stages; recomputing each block's activations in the backward pass
    (never the embedding's, whose input is token ids) gives the losses of the run that keeps them (over the first
    10 steps, the warm-up's, where the two runs' learning rates agree though their lengths differ)."""
    out, _ = pipelined["gpt2"]
    rows, evals = read_metrics(out)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1 and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert read_summary(out)["eval_perplexity"] > 1
    plain = [r["loss"] for r in read_metrics(pipelined["gpt2-plain"][0])[0]]
    assert len(plain) == 10 and max(abs(a - r["loss"]) for a, r in zip(plain, rows)) < 1e-6


def _tied_after_training(rank, world):
    """2 stages of gpt2-tiny train 3 steps; the token embedding both stages hold must still be one tensor."""
    from app.distributed import dist
    from app.ds import config as ds_config
    from app.distributed import launch
    from conftest import engine_of
    from app.core import resolver
    from app.settings import Settings
    from app.data.tokenizers import byte_tokenizer
    from app.observe.metrics import Meter
    launch.setup(False, 120)
    ds = {**PIPE, "train_micro_batch_size_per_gpu": 4, "train_batch_size": 4}
    torch.manual_seed(0)
    task = resolver.build(Settings(model="gpt2-tiny"))
    model = models.build_hf(task.spec, DataInfo(0, task="causal_lm"), byte_tokenizer(), ds)
    module, _ = pipeline.split(model, "gpt2-tiny", pipeline.StagePlan(2), task)
    engine = engine_of(module, ds_config.fill_scheduler_length(ds, 3))
    forward, meter = pipeline.PipeStep(engine, task, False), Meter(["loss"], engine.device)
    ids = torch.randint(200, (4, 32), generator=torch.Generator().manual_seed(1))
    before = module.tied_modules["wte"].wte.weight.detach().clone()
    for _ in range(3):
        forward.micro_step((ids, ids, torch.ones(4)), meter)
    weight = module.tied_modules["wte"].wte.weight.detach()
    both = [torch.empty_like(weight) for _ in range(world)]
    torch.distributed.all_gather(both, weight)
    assert engine.global_steps == 3 and not torch.equal(weight, before), "the embedding trained"
    assert torch.equal(both[0], both[1]), "stage 0's and stage 1's copies of the tied embedding are identical"
    dist.teardown()


def test_gpt2_tied_embeddings_stay_identical_on_both_stages():
    spawn_ranks(2, _tied_after_training)
