"""Preference tuning end to end: one SGD step does not depend on the split over micro batches, accumulation and ranks
under ZeRO 0 and 3, and is the gradient of the DPO loss computed here; the LoRA reference (adapters off) and a
precomputed one train as the live ones do; the worked example learns under ZeRO-3 on 2 ranks with and without LoRA;
a resumed run continues exactly, also on another world size; public files in TRL's and LLaMA-Factory's forms
train; mistakes are one line."""
import json
import sys

import pytest
import torch

from conftest import FAULTS, REPO, assert_one_error_line, named_jobs, read_metrics, read_summary, run

SPLITS = {"micro 4 x accumulation 1 x 2 ranks": (4, 1, 2), "micro 1 x accumulation 4 x 2 ranks": (1, 4, 2),
          "micro 8 x 1 rank": (8, 1, 1)}
PUBLIC = sorted((REPO / "tests" / "data" / "preference").glob("*.jsonl"))
BETA = 0.1


def sgd(tmp, micro: int, accumulation: int, stage: int, lr: float = 1.0):
    """fp32, plain SGD with no momentum, clipping nor schedule: the weights after one step are the weights before
    minus lr x the step's gradient."""
    path = tmp / f"sgd-{micro}-{accumulation}-{stage}-{lr}.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
                                "optimizer": {"type": "SGD", "params": {"lr": lr}}, "gradient_clipping": 0.0,
                                "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                                "steps_per_print": 10 ** 6}))
    return path


def weights(run_folder, step: int = 1) -> dict:
    from app.tools.export import fp32_state_dict
    return fp32_state_dict(run_folder / "checkpoints" / f"step{step:08d}")


def losses(run_folder) -> list:
    return [row["loss"] for row in read_metrics(run_folder)[0]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every job of this file: the 2-rank ones in one launch, then the one-process ones; {name: (folder, output)}."""
    from app.tools.instructions import write_model, write_pairs
    tmp = tmp_path_factory.mktemp("preference")
    pairs, model = write_pairs(tmp / "data", 2000, seed=0), write_model(tmp / "data", seed=0)
    few = write_pairs(tmp / "few", 64, seed=3)
    tiny = ["--model", "llama-tiny", "--tokenizer", "bytes", "--eval_answers", 0]
    example = ["--model", model, "--dataset", pairs, "--block_size", 128, "--eval_answers", 5]
    zero3 = ["--deepspeed_config", REPO / "ds_configs" / "zero3.json"]
    two, one = {}, {}
    for name, (micro, accumulation, ranks) in SPLITS.items():
        for stage in (0, 3):
            jobs = two if ranks == 2 else one
            jobs[f"{stage} {name}"] = [*tiny, "--dataset", few, "--max_steps", 1, "--deepspeed_config",
                                       sgd(tmp, micro, accumulation, stage)]
    one["before"] = [*tiny, "--dataset", few, "--max_steps", 1, "--deepspeed_config", sgd(tmp, 8, 1, 0, 0.0)]
    two["learnt"] = [*example, *zero3, "--max_steps", 40, "--eval_interval", 20, "--log_interval", 10]
    two["learnt lora"] = [*example, *zero3, "--max_steps", 40, "--eval_interval", 20, "--log_interval", 10,
                          "--lora", "--lora_rank", 16]
    short = [*example, *zero3, "--max_steps", 6, "--log_interval", 1, "--eval_answers", 0]
    for reference in ("live", "precompute"):
        two[f"copy {reference}"] = [*short, "--reference", reference]
        two[f"lora {reference}"] = [*short, "--reference", reference, "--lora"]
    for loss in ("ipo", "hinge", "simpo"):
        two[loss] = [*short, "--preference_loss", loss]
    two["straight"] = [*short, "--max_steps", 10, "--reference", "precompute"]
    two["stopped"] = [*short, "--max_steps", 5, "--reference", "precompute"]
    two["resumed"] = {"argv": [*short, "--max_steps", 10, "--reference", "precompute", "--resume", "auto"],
                      "folder": "stopped"}
    two["stopped on 2 ranks"] = [*short, "--max_steps", 5, "--reference", "precompute"]
    longer = write_model(tmp / "longer", seed=0, layers=1)  # RoPE: the same weights read 1,024 positions
    config = json.loads((longer / "config.json").read_text())
    (longer / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    for path in PUBLIC:  # each file evaluated on itself: UltraFeedback's excerpt is one row
        two[path.stem] = ["--model", longer, "--dataset", path, *zero3, "--max_steps", 2, "--block_size", 512,
                          "--eval_file", path, "--eval_answers", 0]
    two["compiled lora"] = [*short, "--lora", "--compile", "on"]  # crashed on a GPU: refused
    two["pipeline"] = [*tiny, "--dataset", few, "--deepspeed_config", REPO / "ds_configs" / "pipeline.json"]
    # the micro batch "auto" with a frozen ZeRO-3 copy: out of memory from 17 sequences on (9 pairs; the copy's forward
    # of the trial's pairs runs first), so 8 pairs a micro batch, 4 accumulation steps; the same losses as by hand
    auto = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    auto.pop("gradient_accumulation_steps")
    (tmp / "auto.json").write_text(json.dumps({**auto, "train_micro_batch_size_per_gpu": "auto",
                                               "train_batch_size": 64}))
    (tmp / "by-hand.json").write_text(json.dumps({**auto, "train_micro_batch_size_per_gpu": 8,
                                                  "gradient_accumulation_steps": 4}))
    two["auto"] = {"argv": [*short, "--deepspeed_config", tmp / "auto.json"], "env": {"APP_OOM_AT": "17"}}
    two["by hand"] = [*short, "--deepspeed_config", tmp / "by-hand.json"]
    one["classifier"] = ["--model", "bert-tiny", "--tokenizer", "bytes", "--dataset", few]
    one["image"] = ["--model", "cnn", "--task", "preference"]
    one["other world size"] = {"argv": [*short, "--max_steps", 8, "--reference", "precompute", "--resume", "auto"],
                               "folder": "stopped on 2 ranks"}
    refused = {"pipeline", "classifier", "image", "compiled lora"}

    return named_jobs(tmp, two, one, refused, wrapper=(FAULTS,)) | {"data": (tmp / "few", "")}


@pytest.mark.parametrize("stage", [0, 3])
def test_one_steps_gradient_does_not_depend_on_the_split(stage, runs):
    after = {name: weights(runs[f"{stage} {name}"][0]) for name in SPLITS}
    reference = after["micro 8 x 1 rank"]
    for name, found in after.items():
        worst = max((found[k] - reference[k]).abs().max().item() for k in reference)
        assert worst < 1e-6, (name, worst)


def test_the_step_is_the_gradient_of_the_dpo_loss_over_the_steps_pairs(runs):
    """The weights the run took (before minus after, lr 1) are minus the gradient of the mean DPO loss over the
    step's 8 pairs, computed here from the run's own pairs and starting weights, its reference those weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from app.data import loader
    from app.data.preference import pair_rows
    from app.data.text import load_splits
    before_folder = runs["before"][0]
    before, after = weights(before_folder), weights(runs["0 micro 8 x 1 rank"][0])
    hf_files = before_folder / "checkpoints" / "step00000001" / "hf"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_files))
    model.load_state_dict({k.removeprefix("hf."): v for k, v in before.items()})
    tokenizer = AutoTokenizer.from_pretrained(before_folder / "tokenizer")
    train, _ = load_splits(str(runs["data"][0] / "pairs.jsonl"), "", "", 0.1, seed=42)
    rows = pair_rows(train, tokenizer, 1024, "train")
    sampler = loader.ShardSampler(len(rows), 8, shuffle=True, seed=42)
    sampler.set_epoch(0)

    def logp(ids, labels):
        logits = model(input_ids=torch.tensor(ids)[None]).logits[0, :-1]
        target = torch.tensor(labels)[1:]
        kept = target != -100
        return torch.log_softmax(logits.double(), -1)[kept, target[kept]].sum()
    terms = []
    for i, _ in next(iter(sampler)):
        row = rows[i]
        chosen, rejected = logp(row["chosen"], row["chosen_labels"]), logp(row["rejected"], row["rejected_labels"])
        delta = (chosen - chosen.detach()) - (rejected - rejected.detach())  # the reference: the same weights
        terms.append(-torch.nn.functional.logsigmoid(BETA * delta))
    model.zero_grad()
    (sum(terms) / len(terms)).backward()
    taken = {k.removeprefix("hf."): before[k] - after[k] for k in before}
    worst = max((taken[n] - p.grad.float()).abs().max().item() for n, p in model.named_parameters())
    largest = max(p.grad.abs().max().item() for p in model.parameters())
    assert largest > 1e-4 and worst < 1e-5, (worst, largest)


def test_the_lora_reference_and_a_precomputed_one_train_as_the_live_ones(runs):
    """LoRA's reference, the model with its adapters off, is the base model a frozen copy would hold: its losses
    equal those of a reference computed once at the start, while the adapters were still zero; likewise a frozen
    copy and a precomputed one."""
    for kind in ("copy", "lora"):
        live, precomputed = losses(runs[f"{kind} live"][0]), losses(runs[f"{kind} precompute"][0])
        assert len(live) == 6 and live[-1] < live[0], (kind, live)
        assert max(abs(a - b) for a, b in zip(live, precomputed)) < 1e-6, (kind, live, precomputed)
    assert "reference: adapters off" in runs["lora live"][1]
    assert "reference: frozen copy" in runs["copy live"][1]
    assert "computed once and kept in" in runs["copy precompute"][1]


def test_each_loss_trains_and_the_rewards_are_logged(runs):
    for loss in ("ipo", "hinge", "simpo"):
        train, held = read_metrics(runs[loss][0])
        assert train[-1]["loss"] < train[0]["loss"], (loss, train)
        assert held[-1]["eval_reward_accuracy"] > 0.5, (loss, held)
        assert f"preference: {loss} loss" in runs[loss][1]
    assert "reference: none (SimPO)" in runs["simpo"][1]


@pytest.mark.parametrize("name", ["learnt", "learnt lora"])
def test_the_worked_example_learns_the_preferred_answers_under_zero3_on_two_ranks(name, runs):
    folder, output = runs[name]
    assert "ZeRO stage 3" in output and "2 rank(s)" in output
    train, held = read_metrics(folder)
    assert train[-1]["reward_margin"] > 0 and train[-1]["rewards_chosen"] > train[-1]["rewards_rejected"]
    accuracy = [row["eval_reward_accuracy"] for row in held]  # a guess: 0.5
    assert accuracy[-1] > accuracy[0] and accuracy[-1] >= (0.7 if "lora" in name else 0.85), accuracy
    summary = read_summary(folder)
    assert summary["task"] == "preference" and summary["eval_reward_accuracy"] == accuracy[-1]
    answers = [json.loads(line) for line in (folder / "answers" / "step00000040.jsonl").read_text().splitlines()]
    assert len(answers) == 5 and all(a["expected"] for a in answers)


def test_a_resumed_run_continues_exactly_also_on_another_world_size(runs):
    straight, resumed = read_metrics(runs["straight"][0])[0], read_metrics(runs["stopped"][0])[0]
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(straight, resumed)) < 1e-6
    assert "read from" in runs["resumed"][1]
    other = runs["other world size"][1]
    assert "converting it to a universal checkpoint" in other and "read from" in other
    assert [r["step"] for r in read_metrics(runs["stopped on 2 ranks"][0])[0]] == list(range(1, 9))


def test_the_micro_batch_auto_counts_pairs_and_its_trials_leave_no_trace(runs):
    output, folder = runs["auto"][1], runs["auto"][0]
    line = next(line for line in output.splitlines() if line.startswith("micro batch: "))
    assert '"auto" picked 8, the largest of' in line and "4 accumulation step(s)" in line, line
    assert losses(folder) == losses(runs["by hand"][0])


def test_the_exported_model_holds_the_chat_template(runs):
    folder = runs["learnt"][0]
    result = run([sys.executable, "-m", "app.tools.export", folder, folder.parent / "exported"])
    assert result.returncode == 0, result.stdout + result.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder.parent / "exported")
    assert tokenizer.chat_template and AutoModelForCausalLM.from_pretrained(folder.parent / "exported")


@pytest.mark.parametrize("path", PUBLIC, ids=[p.stem for p in PUBLIC])
def test_public_preference_files_train(path, runs):
    folder, output = runs[path.stem]
    assert "preference pairs (" in output
    assert all(r["loss"] == r["loss"] for r in read_metrics(folder)[0])


def test_preference_mistakes_are_one_line(runs):
    assert_one_error_line(runs["compiled lora"][1], "--compile on: LoRA's reference", "ZeRO-3", "--compile off")
    assert_one_error_line(runs["pipeline"][1], "preference pairs train under data parallel and ZeRO 0-3")
    assert_one_error_line(runs["classifier"][1], "preference pairs", "sequence classifier")
    assert_one_error_line(runs["image"][1], "--task preference", "image model")
