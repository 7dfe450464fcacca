"""Pipeline parallelism: the "pipeline" section, the split of each model family, and real pipelined runs (gloo,
2 and 3 CPU ranks) against one process."""
import json

import pytest
import torch
from torch import nn

from app.core import models
from app.parallel import pipeline
from app.data import DataInfo
from app.data.loader import ShardSampler
from app.errors import UserError
from conftest import REPO, assert_one_error_line, config_variant, main_each, read_metrics, read_summary, \
    spawn_ranks, train_jobs, write_text_rows
from test_train import one_process_reference

DP = json.loads((REPO / "ds_configs" / "dp.json").read_text())
PIPE = json.loads((REPO / "ds_configs" / "pipeline.json").read_text())


def test_pipeline_json_plans_two_stages():
    assert pipeline.stage_plan(PIPE, 2, "pipeline.json") == pipeline.StagePlan(2, "parameters", 0)
    assert pipeline.stage_plan(DP, 2, "dp.json") is None


@pytest.mark.parametrize("section, zero, world, text", [
    ({"stages": 2, "partiton": "uniform"}, 0, 2, "unknown key pipeline.partiton (did you mean 'partition'?)"),
    ({"stages": "2"}, 0, 2, "pipeline.stages must be int"),
    ({"stages": 0}, 0, 2, "set pipeline.stages"),
    ({"stages": 2, "partition": "best"}, 0, 2, "pipeline.partition must be one of parameters, uniform, type:"),
    ({"stages": 2}, 2, 2, "cannot pipeline with ZeRO stage 2"),
    ({"stages": 2}, 3, 2, "cannot pipeline with ZeRO stage 3"),
    ({"stages": 2}, 0, 3, "pipeline.stages 2 does not divide the world size 3"),
    ({"stages": 2, "activation_checkpoint_interval": -1}, 0, 2, "activation_checkpoint_interval must be 0"),
])
def test_a_wrong_pipeline_section_is_one_line(section, zero, world, text):
    ds = {**DP, "pipeline": section, "zero_optimization": {"stage": zero}}
    with pytest.raises(UserError) as caught:
        pipeline.stage_plan(ds, world, "x.json")
    assert text in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("world, stages", [(2, 2), (4, 2), (6, 3), (6, 2), (3, 3)])
def test_data_parallel_rank_follows_deepspeeds_topology(world, stages):
    """The loader's shard is the replica DeepSpeed's pipe-major topology gives the rank, not the world rank."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    topology = PipeDataParallelTopology(num_pp=stages, num_dp=world // stages)
    for rank in range(world):
        coord = topology.get_coord(rank)
        assert pipeline.data_parallel(pipeline.StagePlan(stages), world, rank) == (coord.data, world // stages)


def test_two_stages_by_two_replicas_see_every_sample_once_per_epoch():
    """4 ranks = 2 stages x 2 replicas: the two replicas split the epoch, the stages of a replica share theirs."""
    seen = {}
    for rank in range(4):
        replica, replicas = pipeline.data_parallel(pipeline.StagePlan(2), 4, rank)
        sampler = ShardSampler(101, 8, replica, replicas, shuffle=True, seed=3)
        sampler.set_epoch(1)
        seen[rank] = [i for batch in sampler for i, w in batch if w > 0]
    assert seen[0] == seen[2] and seen[1] == seen[3], "stage 0 and stage 1 of a replica load the same samples"
    assert sorted(seen[0] + seen[1]) == list(range(101)), "each sample once per epoch across the replicas"


def chained(layers: list, x):
    """Run a split model's layers one after another, as the stages do between them."""
    built = {}
    for layer in layers:
        if isinstance(layer, nn.Module):
            x = layer(x)
        else:  # a TiedLayerSpec: one module per key, the output projection through its forward_fn
            module = built.setdefault(layer.key, layer.build())
            x = layer.forward_fn(module, x) if layer.forward_fn else module(x)
    return x


@pytest.mark.parametrize("name, info, x", [
    ("cnn", DataInfo(10, 1, 8), torch.randn(4, 1, 8, 8)),
    ("mlp", DataInfo(10, 1, 8), torch.randn(4, 1, 8, 8)),
    ("resnet18", DataInfo(10, 3, 32), torch.randn(4, 3, 32, 32)),
])
def test_image_models_split_into_layers_that_compute_the_same(name, info, x):
    torch.manual_seed(0)
    model = models.build_model(name, info).eval()
    layers = pipeline.layers_of(model, name)
    with torch.no_grad():
        assert torch.equal(chained(layers, x), model(x))
    names = pipeline.layer_names(model, layers)
    assert sorted(n for own in names for many in own.values() for n in many) == sorted(model.state_dict())


def test_gpt2_splits_with_tied_embeddings_and_causal_blocks():
    """Each block stays causal on its own: a later token never changes an earlier position's logits."""
    from app.data.tokenizers import byte_tokenizer
    torch.manual_seed(0)
    model = models.build_hf(models.hf_spec("gpt2-tiny"), DataInfo(0, task="causal_lm"), byte_tokenizer(), {})
    model.eval()
    layers = pipeline.layers_of(model, "gpt2-tiny")
    assert layers[0].key == layers[-1].key == "wte" and layers[-1].forward_fn is pipeline.tied_logits
    ids = torch.randint(200, (2, 16))
    with torch.no_grad():
        split, whole = chained(layers, ids), model(ids)
        changed = ids.clone()
        changed[:, 10:] = (changed[:, 10:] + 1) % 200
        later = chained(layers, changed)
    assert torch.allclose(split, whole, atol=1e-5, rtol=0)
    assert torch.equal(later[:, :10], split[:, :10]) and not torch.equal(later[:, 10:], split[:, 10:])
    assert (split[..., models.vocab_size(model.hf.config):] == float("-inf")).all(), "padded rows never win"
    names = pipeline.layer_names(model, layers)
    assert "hf.lm_head.weight" in names[0]["wte.weight"] and "hf.transformer.wte.weight" in names[0]["wte.weight"]


def test_a_model_that_cannot_be_split_says_why():
    from app.data.tokenizers import byte_tokenizer
    bert = models.build_hf(models.hf_spec("bert-tiny"), DataInfo(2, task="sequence_classification"),
                           byte_tokenizer(), {})
    with pytest.raises(UserError, match="bert-tiny cannot be split into pipeline stages.*ZeRO stage 3"):
        pipeline.layers_of(bert, "bert-tiny")


def test_more_stages_than_layers_is_one_line():
    model = models.build_model("mlp", DataInfo(10, 1, 8))
    with pytest.raises(UserError, match="pipeline.stages 5 is more than the 4 layers mlp splits into"):
        pipeline.split(model, "mlp", pipeline.StagePlan(5), task=None)


@pytest.mark.slow
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
    """tag -> (output_dir, stdout) of the pipelined runs, one after another in one 2-rank deepspeed launch."""
    root = tmp_path_factory.mktemp("pipelined")
    corpus = write_text_rows(root / "corpus.txt", 600)
    steps = ["--max_steps", 12, "--log_interval", 1]
    jobs = {
        "zero0": ["--deepspeed_config", variant(root, "zero0", train_micro_batch_size_per_gpu=8), *steps],
        "zero1": ["--deepspeed_config", variant(root, "zero1", train_micro_batch_size_per_gpu=8,
                                                zero_optimization={"stage": 1}), *steps],
        "resnet18": ["--deepspeed_config", variant(root, "resnet18", train_micro_batch_size_per_gpu=16,
                                                   pipeline={"stages": 2, "partition": "type:BasicBlock",
                                                             "activation_checkpoint_interval": 1}),
                     "--model", "resnet18", "--dataset", "synthetic", "--max_steps", 4, "--log_interval", 1],
    }
    for tag, interval in (("gpt2", 1), ("gpt2-plain", 0)):  # activations recomputed in the backward pass, or kept
        config = variant(root, tag, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=2,
                         pipeline={"stages": 2, "activation_checkpoint_interval": interval})
        jobs[tag] = ["--deepspeed_config", config, "--model", "gpt2-tiny", "--dataset", corpus, "--block_size", 32,
                     "--max_steps", 30, "--log_interval", 1, "--eval_interval", 15]
    outputs = train_jobs("deepspeed", 2, [[*args, "--output_dir", root / tag] for tag, args in jobs.items()])
    return {tag: (root / tag, out) for tag, out in zip(jobs, outputs)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per-step losses of plain data parallel in one process, micro batch 8 (the pipelines' global batch)."""
    return one_process_reference(tmp_path_factory.mktemp("reference"))


@pytest.mark.slow
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


@pytest.mark.slow
def test_three_stages_on_three_ranks_give_the_losses_of_one_process(tmp_path, reference):
    config = config_variant(tmp_path, "pipeline", train_micro_batch_size_per_gpu=8,
                            pipeline={"stages": 3, "partition": "type:Conv2d|Linear"})
    out, = train_jobs("deepspeed", 3, [["--deepspeed_config", config, "--max_steps", 12, "--log_interval", 1,
                                        "--output_dir", tmp_path / "run"]])
    assert "pipeline: 3 stages x 1 data-parallel replica(s)" in out and "layers by stage 0: 0-5, 1: 6-7, 2: 8-8" in out
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")[0]]
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 1e-5, list(zip(losses, reference))


@pytest.mark.slow
def test_resnet18_splits_trains_and_exports_to_plain_torchvision(pipelined, tmp_path):
    """The exported fp32 weights load into an unsplit torchvision ResNet-18 and give the pipeline's eval loss."""
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


@pytest.mark.slow
def test_gpt2_pipeline_learns_and_checkpointing_activations_changes_nothing(pipelined):
    """2 micro batches per step through 2 stages; recomputing each block's activations in the backward pass
    (never the embedding's, whose input is token ids) gives the losses of the run that keeps them."""
    out, _ = pipelined["gpt2"]
    rows, evals = read_metrics(out)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1 and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert read_summary(out)["eval_perplexity"] > 1
    plain = [r["loss"] for r in read_metrics(pipelined["gpt2-plain"][0])[0]]
    assert max(abs(a - r["loss"]) for a, r in zip(plain, rows)) < 1e-6


def _tied_after_training(rank, world):
    """2 stages of gpt2-tiny train 3 steps; the token embedding both stages hold must still be one tensor."""
    from app.distributed import dist
    from app.ds import config as ds_config
    from app.distributed import launch
    from app.core import loop
    from app.core import tasks
    from app.settings import Settings
    from app.data.tokenizers import byte_tokenizer
    from app.observe.metrics import Meter
    launch.setup(False, 120)
    ds = {**PIPE, "train_micro_batch_size_per_gpu": 4, "train_batch_size": 4}
    torch.manual_seed(0)
    task = tasks.build(Settings(model="gpt2-tiny"))
    model = models.build_hf(task.spec, DataInfo(0, task="causal_lm"), byte_tokenizer(), ds)
    module, _ = pipeline.split(model, "gpt2-tiny", pipeline.StagePlan(2), task)
    engine = loop.build_engine(module, ds_config.fill_scheduler_length(ds, 3))
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


@pytest.mark.slow
def test_gpt2_tied_embeddings_stay_identical_on_both_stages():
    spawn_ranks(2, _tied_after_training)
