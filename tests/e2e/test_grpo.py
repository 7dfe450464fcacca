"""Online RL (--task grpo) end to end: one SGD step does not depend on the split over micro batches, accumulation and
ranks, under ZeRO 0 and 3, for each loss; ranks whose completions end at very different lengths finish the step
under ZeRO-3; a resumed run samples and trains exactly as the unbroken one; --num_iterations trains each batch of
completions again, clipped against the policy that sampled it, and a run stopped inside such a cycle ends it on
any world size; the worked example's held-out reward rises under ZeRO-3 on 2 ranks, with and without LoRA;
mistakes are one line."""
import csv
import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, config_variant, named_jobs, read_metrics, read_summary, train_jobs
from e2e.test_preference import sgd  # fp32 SGD: the weights after a step are those before less lr x its gradient

SPLITS = {"micro 4 x accumulation 1 x 2 ranks": (4, 1, 2), "micro 1 x accumulation 4 x 2 ranks": (1, 4, 2),
          "micro 8 x 1 rank": (8, 1, 1)}
LOSSES = ("dapo", "grpo", "dr_grpo")
LOGGED = "micro 1 x accumulation 4 x 2 ranks"  # the split whose completions --log_completions writes
REWARDS = '''
def text(completion):
    """A completion's text: as written for a plain prompt, the message's content for a conversational one."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def length(completions, **kwargs):
    """Longer answers score more: the groups' rewards differ, so the step has a gradient."""
    return [len(text(c)) / 10 for c in completions]


def has_e(completions, answer, **kwargs):
    """None (not applicable) where the expected answer has no e."""
    return [None if "e" not in a else float("e" in text(c)) for c, a in zip(completions, answer)]
'''


def evaluations(run_folder: Path) -> list:
    """The evaluation rows of metrics.csv, numbers parsed: a GRPO run's have eval_reward, no eval_loss."""
    with open(run_folder / "metrics.csv") as f:
        rows = [{k: (float(v) if v != "" else None) for k, v in row.items()} for row in csv.DictReader(f)]
    return [row for row in rows if row["eval_reward"] is not None]


def weights(run_folder: Path, step: int = 1) -> dict:
    from app.tools.export import fp32_state_dict
    return fp32_state_dict(run_folder / "checkpoints" / f"step{step:08d}")


def ending_model(folder: Path) -> Path:
    """The example's tiny Llama, its end-of-text row twice the direction of '!': after a '!' the end comes with
    probability 0.98, after other tokens with 0.02 on average (measured on this model), so a prompt ending in '!'
    ends at once and another mostly runs on."""
    from transformers import AutoModelForCausalLM
    from app.data.tokenizers import byte_tokenizer
    from app.tools.instructions import write_model
    model_folder = write_model(folder, seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_folder)
    tokenizer = byte_tokenizer()
    bang = model.model.embed_tokens.weight[tokenizer("!", add_special_tokens=False)["input_ids"][0]]
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 2 * bang / bang.norm()
    model.save_pretrained(model_folder)
    return model_folder


def lr_copy(tmp: Path, lr: float) -> Path:
    """zero3.json at a learning rate, 16 prompts a micro batch: RL after SFT wants a smaller step than zero3.json's
    2e-3 for the whole model."""
    ds = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    ds["optimizer"]["params"]["lr"], ds["train_micro_batch_size_per_gpu"] = lr, 16
    path = tmp / f"zero3-lr{lr:g}.json"
    path.write_text(json.dumps(ds))
    return path


def worked_start(tmp: Path, base_env=None) -> Path:
    """The worked example's first half: the instruction example's model tuned on its chats for 60 steps under
    ZeRO-3 on 2 ranks, exported (docs/rl.md, "A worked example"); base_env: the ranks' environment (a GPU's)."""
    from app.tools import export
    from app.tools.instructions import write, write_model
    chats, model = write(tmp / "sft-data", 2000, seed=0), write_model(tmp / "sft-data", seed=0)
    train_jobs("ranks", 2, [["--model", model, "--dataset", chats, "--deepspeed_config", REPO / "ds_configs" /
                             "zero3.json", "--max_steps", 60, "--eval_interval", 60, "--block_size", 128,
                             "--eval_answers", 0, "--output_dir", tmp / "sft"]], base_env=base_env)
    assert export.main([str(tmp / "sft"), str(tmp / "sft-model")]) == 0
    return tmp / "sft-model"


def worked_example(sft: Path, prompts: Path) -> list:
    """The worked example's GRPO flags: the tuned model, the prompts and their exact-match reward, 60 steps."""
    return ["--task", "grpo", "--model", sft, "--dataset", prompts, "--reward", f"{prompts.parent / 'rewards.py'}"
            ":exact_answer", "--num_generations", 8, "--max_completion_length", 8, "--max_steps", 60,
            "--eval_interval", 20, "--log_interval", 10, "--eval_answers", 0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every job of this file: the 2-rank ones in one launch, then the one-process ones; {name: (folder, output)}."""
    from app.tools.instructions import write_prompts
    tmp = tmp_path_factory.mktemp("grpo")
    prompts = write_prompts(tmp / "data", 600, seed=1)
    few = write_prompts(tmp / "few", 12, seed=3)
    (tmp / "rewards.py").write_text(REWARDS)
    tiny = ["--model", "llama-tiny", "--tokenizer", "bytes", "--task", "grpo", "--eval_answers", 0,
            "--reward", f"{tmp / 'rewards.py'}:length,{tmp / 'rewards.py'}:has_e", "--num_generations", 2,
            "--max_completion_length", 6, "--eval_fraction", 0.25]
    two, one = {}, {}
    for name, (micro, accumulation, ranks) in SPLITS.items():
        for stage in (0, 3):
            for loss in LOSSES:
                jobs = two if ranks == 2 else one
                jobs[f"{stage} {loss} {name}"] = [*tiny, "--dataset", few, "--max_steps", 1, "--grpo_loss", loss,
                                                  "--deepspeed_config", sgd(tmp, micro, accumulation, stage)]
    two[f"3 dapo {LOGGED}"].append("--log_completions")
    two["mu"] = [*tiny, "--dataset", few, "--max_steps", 2, "--num_iterations", 2, "--log_completions",
                 "--save_interval", 1, "--log_interval", 1, "--deepspeed_config", sgd(tmp, 1, 4, 3)]
    # zero3.json's Adam (DeepSpeed converts its ZeRO-3 checkpoints to another world size, not SGD's) at micro 2 x
    # accumulation 2 on 2 ranks: windows of 8 of the 9 prompts, which span epochs; on 1 rank micro 4 makes the same
    cycle = [*tiny, "--dataset", few, "--max_steps", 4, "--num_iterations", 2, "--save_interval", 1, "--log_interval",
             1, "--deepspeed_config"]
    zero3 = {}
    for micro in (2, 4):
        (tmp / f"micro{micro}").mkdir()
        zero3[micro] = config_variant(tmp / f"micro{micro}", "zero3", train_micro_batch_size_per_gpu=micro,
                                      gradient_accumulation_steps=2)
    two["mu adam"] = [*cycle, zero3[2]]
    inside = ["--resume", tmp / "mu adam" / "checkpoints" / "step00000003"]  # a cycle's first step, not its second
    two["mu resumed"] = [*cycle, zero3[2], *inside]
    one["mu resumed on one rank"] = [*cycle, zero3[4], *inside]
    one["mu other windows"] = [*cycle, zero3[2], *inside]
    # the model before the step, as ZeRO-3 builds it (under zero.Init): one step at learning rate 0
    one["initial"] = [*tiny, "--dataset", few, "--max_steps", 1, "--deepspeed_config", sgd(tmp, 8, 1, 3, lr=0.0)]
    for name, (micro, accumulation, ranks) in list(SPLITS.items())[:2]:  # sampled layer by layer, every rank in step
        two[f"3 dapo {name} unGathered"] = [*tiny, "--dataset", few, "--max_steps", 1, "--grpo_loss", "dapo",
                                             "--gather_for_generation", "off",
                                             "--deepspeed_config", sgd(tmp, micro, accumulation, 3)]
    for name in ("ends.jsonl", "ends-held.jsonl"):  # the same two rows to train on and to hold out
        (tmp / name).write_text('{"prompt": "Stop here!", "answer": "e"}\n{"prompt": "Go on?", "answer": "e"}\n')
    for gather in ("on", "off"):
        two[f"uneven {gather}"] = [*tiny, "--model", ending_model(tmp / "ends"), "--dataset", tmp / "ends.jsonl",
                                   "--eval_file", tmp / "ends-held.jsonl", "--max_completion_length", 48,
                                   "--max_steps", 2, "--log_interval", 1, "--dist_timeout", 60,
                                   "--gather_for_generation", gather, "--deepspeed_config", sgd(tmp, 1, 1, 3)]
    zero3 = ["--deepspeed_config", REPO / "ds_configs" / "zero3.json"]
    short = [*tiny, "--dataset", few, *zero3, "--log_interval", 1, "--beta", "0.05", "--eval_interval", 2,
             "--eval_sampling", "sampled"]
    example = worked_example(worked_start(tmp), prompts)
    two["before"] = [*example, "--deepspeed_config", lr_copy(tmp, 0.0), "--max_steps", 1]
    two["learnt"] = [*example, "--deepspeed_config", lr_copy(tmp, 5e-4)]
    # LoRA at zero3.json's own rate, 16 prompts a micro batch as the whole model (the page's 32 take twice as long)
    two["learnt lora"] = [*example, "--deepspeed_config", lr_copy(tmp, 2e-3), "--lora", "--lora_rank", 16]
    two["straight"] = [*short, "--max_steps", 4]
    two["stopped"] = [*short, "--max_steps", 2]
    two["resumed"] = {"argv": [*short, "--max_steps", 4, "--resume", "auto"], "folder": "stopped"}
    two["pipeline"] = [*tiny, "--dataset", few, "--deepspeed_config", REPO / "ds_configs" / "pipeline.json"]
    one["classifier"] = ["--model", "bert-tiny", "--tokenizer", "bytes", "--dataset", few, "--task", "grpo",
                         "--reward", f"{tmp / 'rewards.py'}:length"]
    one["no reward"] = ["--model", "llama-tiny", "--tokenizer", "bytes", "--dataset", few, "--task", "grpo"]
    refused = {"pipeline", "classifier", "no reward", "mu other windows"}

    return named_jobs(tmp, two, one, refused) | {"data": (tmp / "data", "")}


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("stage", [0, 3])
def test_one_steps_gradient_does_not_depend_on_the_split(stage, loss, runs):
    """The completions belong to the seed, the step, the row and their number in the group, so every split samples
    the same ones; the loss's normalisation over the whole step then gives the same gradient."""
    after = {name: weights(runs[f"{stage} {loss} {name}"][0]) for name in SPLITS}
    reference = after["micro 8 x 1 rank"]
    for name, found in after.items():
        worst = max((found[k] - reference[k]).abs().max().item() for k in reference)
        assert worst < 1e-6, (name, worst)
    rows = read_metrics(runs[f"{stage} {loss} micro 8 x 1 rank"][0])[0]
    assert rows[0]["reward_std"] > 0 and rows[0]["completions/mean_length"] > 0, "a step with a gradient"
    assert 0 <= rows[0]["rewards/has_e/mean"] <= 1


def completion_logps(model, line: dict) -> torch.Tensor:
    """The log-probability of each of a logged completion's tokens under the model."""
    ids = torch.tensor(line["prompt_ids"] + line["ids"])[None]
    start = len(line["prompt_ids"])
    logp = torch.log_softmax(model(ids).logits[0, start - 1:-1].float(), -1)
    return logp.gather(-1, ids[0, start:, None])[:, 0]


def loss_of(kind: str, model, lines: list, max_new: int, old: list = None) -> torch.Tensor:
    """The step's loss written here from TRL's formulas, on the logged completions: each token's loss is
    -min(ratio x advantage, clip(ratio, 0.8, 1.2) x advantage), weighed as the loss says. The ratio is against old,
    the log-probabilities of the policy that sampled; without old (one iteration) it is 1, its gradient that of the
    log-probability."""
    per_token = []
    for k, line in enumerate(lines):
        taken = completion_logps(model, line)
        ratio = torch.exp(taken - (taken.detach() if old is None else old[k]))
        a = line["advantage"]
        per_token.append(-torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a))
    if kind == "dapo":
        return sum(t.sum() for t in per_token) / sum(len(t) for t in per_token)
    if kind == "grpo":
        return sum(t.mean() for t in per_token) / len(per_token)
    return sum(t.sum() for t in per_token) / (len(per_token) * max_new)


def initial_model(runs) -> Path:
    """The model before any step, as ZeRO-3 builds it: the lr-0 run's checkpoint exported (once)."""
    from app.tools.export import export
    folder = runs["initial"][0] / "exported"
    if not (folder / "config.json").is_file():
        export(runs["initial"][0] / "checkpoints" / "step00000001", folder)
    return folder


@pytest.mark.parametrize("loss", LOSSES)
def test_the_steps_gradient_is_that_of_the_loss_computed_here_from_its_completions(loss, runs):
    """The logged completions of one step (ZeRO-3, micro 1 x accumulation 4 x 2 ranks; each loss samples the same),
    the model before it (a run at learning rate 0, exported): the gradient of the loss computed in this test from
    them is what one SGD step at lr 1 took off the weights."""
    from transformers import AutoModelForCausalLM
    folder = runs[f"3 dapo {LOGGED}"][0]
    lines = [json.loads(line) for line in (folder / "completions" / "step00000001.jsonl").read_text().splitlines()]
    assert len(lines) == 8 * 2 and {line["completion"] for line in lines} == {0, 1}, "a step of 8 prompts x 2"
    assert any(line["advantage"] != 0 for line in lines) and all(len(line["ids"]) <= 6 for line in lines)
    model = AutoModelForCausalLM.from_pretrained(initial_model(runs), torch_dtype=torch.float32)
    loss_of(loss, model, lines, max_new=6).backward()
    before, after = weights(runs["initial"][0]), weights(runs[f"3 {loss} {LOGGED}"][0])
    compared = 0
    for name, param in model.named_parameters():
        key = f"hf.{name}"
        if key in before and param.grad is not None:
            worst = (before[key] - after[key] - param.grad).abs().max().item()
            assert worst < 1e-6, (name, worst)
            compared += 1
    assert compared >= len(list(model.parameters())) - 1, "every weight (the output layer may be tied)"


def test_num_iterations_trains_each_batch_of_completions_again_clipped_against_the_policy_that_sampled_it(runs):
    """--num_iterations 2, ZeRO-3 on 2 ranks, SGD at lr 1: step 2 trains on step 1's completions (logged alike), and
    the weights after each step are those of the loss computed here, from TRL's formula, with the ratio against the
    model before step 1 (exported from the run at lr 0) and clipped at 1 -/+ 0.2."""
    from transformers import AutoModelForCausalLM
    folder = runs["mu"][0]
    logged = [[json.loads(line) for line in (folder / "completions" / f"step{step:08d}.jsonl").read_text().splitlines()]
              for step in (1, 2)]
    assert [{**line, "step": 0} for line in logged[0]] == [{**line, "step": 0} for line in logged[1]]
    rows = read_metrics(folder)[0]
    assert rows[0]["clip_ratio/region_mean"] == 0 < rows[1]["clip_ratio/low_mean"] and \
        0 < rows[1]["clip_ratio/high_mean"] and rows[1]["clip_ratio/region_mean"] < 0.8, "some tokens clipped, not all"
    model = AutoModelForCausalLM.from_pretrained(initial_model(runs), torch_dtype=torch.float32)
    with torch.no_grad():
        old = [completion_logps(model, line) for line in logged[0]]
    for step in (1, 2):
        model.zero_grad()
        loss_of("dapo", model, logged[0], max_new=6, old=old).backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= param.grad  # SGD at lr 1
        after = weights(folder, step)
        worst = max((after[f"hf.{name}"] - param).abs().max().item() for name, param in model.named_parameters())
        assert worst < 1e-6, (step, worst)


def test_a_run_stopped_inside_a_cycle_ends_it_on_its_kept_completions_on_any_world_size(runs):
    """Resumed after step 3, the first of the second cycle of 2 (micro 2 x accumulation 2 x 2 ranks), on 2 ranks and
    on 1 (micro 4: the same windows), step 4 trains on the completions step 3 kept: the weights and loss of the
    unbroken run. On 1 rank with micro 2 the windows would differ: one line."""
    folder = runs["mu adam"][0]
    unbroken = weights(folder, 4)
    assert (folder / "checkpoints" / "step00000003" / "grpo_kept_rank00001.pt").is_file()
    assert not (folder / "checkpoints" / "step00000004" / "grpo_kept_rank00000.pt").exists(), \
        "a checkpoint at a cycle's end keeps nothing"
    for name, bound in (("mu resumed", 0.0), ("mu resumed on one rank", 1e-6)):
        resumed, output = runs[name]
        assert "resume:" in output and "at step 3, epoch" in output, output[-2000:]
        after = weights(resumed, 4)
        assert max((unbroken[k] - after[k]).abs().max().item() for k in unbroken) <= bound, name
        assert abs(read_metrics(resumed)[0][-1]["loss"] - read_metrics(folder)[0][-1]["loss"]) <= bound + 1e-9
    assert "trains each window of prompts 2 times (--num_iterations) over windows of 2 global micro batch(es) of 4; " \
        "this run has 2 of 2" in runs["mu other windows"][1]


def test_sampling_gathered_once_or_layer_by_layer_takes_the_same_step_under_zero3(runs):
    """The whole model gathered once for sampling (auto, on a CPU where it fits) and gathered layer by layer for
    each token (off) sample the same completions: the weights after the step agree."""
    for name in list(SPLITS)[:2]:
        gathered, layered = (weights(runs[f"3 dapo {name}{kind}"][0]) for kind in ("", " unGathered"))
        assert max((gathered[k] - layered[k]).abs().max().item() for k in gathered) < 1e-6, name
    assert "grpo: sampling gathers the whole model once a micro batch" in runs[f"3 dapo {name}"][1]
    assert "grpo: sampling gathers the model layer by layer for each token" in runs[f"3 dapo {name} unGathered"][1]


@pytest.mark.parametrize("gather", ["on", "off"])
def test_ranks_whose_completions_end_far_apart_finish_the_step_under_zero3(gather, runs):
    """One rank's prompt ends at once, the other's runs to 48 tokens. Gathered layer by layer, the first keeps
    stepping with the second until both have ended (every forward gathers from both); gathered whole, no decoding
    step gathers. Either way the run ends."""
    folder, output = runs[f"uneven {gather}"]
    assert "ZeRO stage 3" in output and "2 rank(s)" in output
    rows = read_metrics(folder)[0]
    assert len(rows) == 2, "both steps ran"
    first = rows[0]  # (SGD at lr 1 then changes the model: the second step's completions are another matter)
    assert 5 < first["completions/mean_length"] < 40 and first["completions/clipped_ratio"] > 0, \
        "one rank's two completions ended at once, the other's ran on, one of them to the end"


def test_a_resumed_run_samples_and_trains_exactly_as_the_unbroken_one(runs):
    """The same completions, losses and (sampled) evaluations."""
    straight, resumed = read_metrics(runs["straight"][0])[0], read_metrics(runs["stopped"][0])[0]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed):
        for column in ("loss", "reward", "completions/mean_length", "kl"):
            assert abs(a[column] - b[column]) < 1e-6, (column, a, b)
    evaluated = [evaluations(runs[name][0]) for name in ("straight", "stopped")]
    assert [r["step"] for r in evaluated[0]] == [r["step"] for r in evaluated[1]] == [2, 4]
    for a, b in zip(*evaluated):
        assert abs(a["eval_reward"] - b["eval_reward"]) < 1e-9 and \
            a["eval_completions/mean_length"] == b["eval_completions/mean_length"], (a, b)


@pytest.mark.parametrize("name", ["learnt", "learnt lora"])
def test_the_worked_example_learns_its_answers_under_zero3_on_two_ranks(name, runs):
    """After 60 steps of instruction tuning, 60 of GRPO with an exact-match reward raise the held-out reward, the
    greedy answers' share that are exactly right, above where the tuned model started."""
    folder, output = runs[name]
    assert "ZeRO stage 3" in output and "2 rank(s)" in output
    train, _ = read_metrics(folder)
    rewards = [row["eval_reward"] for row in evaluations(folder)]
    start = read_summary(runs["before"][0])["eval_reward"]
    assert len(rewards) == 3 and rewards[-1] > rewards[0], rewards
    assert rewards[-1] >= start + (0.05 if "lora" in name else 0.1) and rewards[-1] >= 0.6, (start, rewards)
    assert train[-1]["reward"] > train[0]["reward"], [row["reward"] for row in train]


def test_grpo_mistakes_are_one_line(runs):
    assert "--task grpo trains under data parallel and ZeRO 0-3" in runs["pipeline"][1]
    assert "--task grpo trains a causal language model on completions it samples" in runs["classifier"][1]
    assert "--task grpo needs --reward FILE.py:NAME" in runs["no reward"][1]


def test_a_grpo_run_says_what_it_trains_and_summarises_its_reward(runs):
    folder, output = runs["straight"]
    summary = read_summary(folder)
    assert summary["task"] == "grpo" and "eval_reward" in summary
    assert "grpo: dapo loss, 2 completions of at most 6 tokens a prompt (temperature 1); rewards length x 1, " \
        "has_e x 1; beta 0.05, reference: frozen copy" in output
