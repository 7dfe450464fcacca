"""Instruction fine-tuning end to end: a step's loss is the mean over every answer token of the global batch however
the batch is split across micro batches, accumulation and ranks; a tiny Llama learns a task from chats under ZeRO-3
on 2 ranks and shows its answers; the export answers as the run did."""
import json
import sys

import pytest
import torch

from conftest import REPO, read_metrics, run, train_jobs, write_text_rows

ANSWERS = {"micro 4 x accumulation 1 x 2 ranks": (4, 1, 2), "micro 1 x accumulation 4 x 2 ranks": (1, 4, 2),
           "micro 8 x 1 rank": (8, 1, 1)}


def sgd(tmp_path, micro: int, accumulation: int, lr: float = 1.0) -> str:
    """ZeRO 0, fp32, plain SGD with no momentum, clipping nor schedule: the weights after one step are the
    weights before minus lr x the step's gradient."""
    path = tmp_path / f"sgd-{micro}-{accumulation}-{lr}.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
                                "optimizer": {"type": "SGD", "params": {"lr": lr}},
                                "gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
                                "steps_per_print": 10 ** 6}))
    return str(path)


def weights(output_dir) -> dict:
    """The model's weights in a run's step-1 checkpoint (ZeRO 0 keeps them whole)."""
    saved = torch.load(output_dir / "checkpoints" / "step00000001" / "mp_rank_00_model_states.pt",
                       map_location="cpu", weights_only=False)
    return saved["module"]


def one_step_jobs(tmp) -> dict:
    """{ranks: jobs} of the split runs: chats of unequal lengths (llama-tiny, answers only), the same packed into
    blocks, and labelled sentences of unequal lengths (bert-tiny): one SGD step under each split of a global batch
    of 8, and the chats' weights before it (lr 0); the last 2-rank job tries packing under pipeline stages, refused
    in one line (exit 2)."""
    from app.tools.instructions import write
    chats = write(tmp / "chats", 64, seed=3)
    labelled = write_text_rows(tmp / "labelled.jsonl", 64, labelled=True)
    common = ["--max_steps", 1, "--eval_answers", 0, "--tokenizer", "bytes"]
    jobs = {1: [], 2: []}
    kinds = (("chat", "llama-tiny", chats, "off"), ("packed", "llama-tiny", chats, "on"),
             ("class", "bert-tiny", labelled, "auto"))
    for name, (micro, accumulation, ranks) in ANSWERS.items():
        for kind, model, data, packing in kinds:
            jobs[ranks].append(["--model", model, "--dataset", data, "--deepspeed_config", sgd(tmp, micro, accumulation),
                                "--packing", packing, *common, "--output_dir", tmp / kind / name])
    jobs[1].append(["--model", "llama-tiny", "--dataset", chats, "--deepspeed_config", sgd(tmp, 8, 1, lr=0.0),
                    "--packing", "off", *common, "--output_dir", tmp / "before"])
    jobs[2].append(["--model", "gpt2-tiny", "--dataset", chats, "--deepspeed_config", REPO / "ds_configs" /
                    "pipeline.json", *common, "--output_dir", tmp / "pipeline"])
    return jobs


def learnt_job(tmp) -> list:
    """The worked example of docs/instruction-tuning.md (app/tools/instructions.py): a tiny Llama folder fine-tuned
    on chats, 2 ranks, ZeRO-3, 60 steps of 128-token blocks, evaluated with 20 answers every 15 steps."""
    from app.tools.instructions import write, write_model
    chats, model = write(tmp, 2000, seed=0), write_model(tmp, seed=0)
    return ["--model", model, "--dataset", chats, "--deepspeed_config", REPO / "ds_configs" / "zero3.json",
            "--max_steps", 60, "--eval_interval", 15, "--log_interval", 15, "--eval_answers", 20, "--block_size", 128,
            "--output_dir", tmp / "run"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(split folder, worked example folder, the worked example's output): every 2-rank job of this file in one
    launch, the split runs' one-process jobs in one process."""
    split, example = tmp_path_factory.mktemp("split"), tmp_path_factory.mktemp("learnt")
    jobs = one_step_jobs(split)
    two = [*jobs[2], learnt_job(example)]
    outputs = train_jobs("ranks", 2, two, codes=[0] * (len(jobs[2]) - 1) + [2, 0])
    train_jobs("python", 1, jobs[1])
    (split / "pipeline.txt").write_text(outputs[-2])
    return split, example, outputs[-1]


@pytest.fixture(scope="module")
def one_step(launched):
    return launched[0]


def test_packing_under_pipeline_stages_is_one_line(one_step):
    from conftest import assert_one_error_line
    assert_one_error_line((one_step / "pipeline.txt").read_text(), "packing and pipeline stages",
                          "pass --packing off")


@pytest.mark.parametrize("kind", ["chat", "packed", "class"])
def test_one_steps_gradient_does_not_depend_on_the_split(kind, one_step):
    after = {name: weights(one_step / kind / name) for name in ANSWERS}
    reference = after["micro 8 x 1 rank"]
    for name, found in after.items():
        assert found.keys() == reference.keys()
        worst = max((found[k] - reference[k]).abs().max().item() for k in reference)
        assert worst < 1e-6, (name, worst)


def test_the_step_is_the_mean_over_every_answer_token_of_the_global_batch(one_step):
    """The gradient the runs took (weights before minus after, lr 1) is that of the answer tokens' mean cross
    entropy over the step's 8 rows, computed here from the run's own rows and starting weights; the mean of each
    row's mean, which weighs a short answer's tokens more, is another gradient."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from app.data import loader
    from app.data.chat import IGNORE
    from app.data.text import instruction_rows, load_splits
    from transformers import AutoTokenizer
    before, after = weights(one_step / "before"), weights(one_step / "chat" / "micro 8 x 1 rank")
    hf_files = one_step / "before" / "checkpoints" / "step00000001" / "hf"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_files))
    model.load_state_dict({k.removeprefix("hf."): v for k, v in before.items()})
    tokenizer = AutoTokenizer.from_pretrained(one_step / "before" / "tokenizer")
    train, _ = load_splits(str(one_step / "chats"), "", "", 0.1, seed=42)
    rows = instruction_rows(train, tokenizer, "messages", 128, False, "train")
    sampler = loader.ShardSampler(len(rows), 8, shuffle=True, seed=42)
    sampler.set_epoch(0)
    picked = [i for i, w in next(iter(sampler))]
    losses, counts = [], []
    for i in picked:
        ids, labels = torch.tensor(rows[i]["input_ids"])[None], torch.tensor(rows[i]["labels"])[None]
        logits = model(input_ids=ids).logits
        each = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=IGNORE,
                                                 reduction="sum")
        losses.append(each)
        counts.append(int((labels[0, 1:] != IGNORE).sum()))
    assert len(set(counts)) > 1, "rows with answers of unequal lengths"
    grads = {}
    for name, loss in (("tokens", sum(losses) / sum(counts)),
                       ("rows", sum(l / c for l, c in zip(losses, counts)) / len(counts))):
        model.zero_grad()
        loss.backward(retain_graph=True)
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    taken = {k.removeprefix("hf."): before[k] - after[k] for k in before}
    worst = {name: max((taken[n] - g[n]).abs().max().item() for n in g) for name, g in grads.items()}
    assert worst["tokens"] < 1e-5, worst
    assert worst["rows"] > 100 * worst["tokens"], worst


@pytest.fixture(scope="module")
def learnt(launched):
    """The worked example's run, then exported as a transformers folder."""
    _, tmp, output = launched
    out = tmp / "run"
    result = run([sys.executable, "-m", "app.tools.export", out, tmp / "exported"])
    assert result.returncode == 0, result.stdout + result.stderr
    return out, tmp / "exported", output


def exact(step_file) -> float:
    rows = [json.loads(line) for line in step_file.read_text().splitlines()]
    assert len(rows) == 20
    return sum(r["answer"] == r["expected"] for r in rows) / len(rows)


def test_a_tiny_llama_learns_the_answers_of_chats_under_zero3_on_two_ranks(learnt):
    out, _, output = learnt
    assert "chat template: the tokenizer has none; using the default" in output
    assert "ZeRO stage 3" in output and "2 rank(s)" in output
    assert "step 60 answers: " in output, "rank 0 shows the answers"
    _, evals = read_metrics(out)
    assert [r["step"] for r in evals] == [15, 30, 45, 60]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] / 4, evals
    scores = [exact(out / "answers" / f"step{step:08d}.jsonl") for step in (15, 30, 45, 60)]
    assert scores[-1] >= 0.7 and scores[-1] > scores[0], f"exact answers {scores}; a guess is right 1 in 20"


def test_the_exported_model_answers_as_the_run_did(learnt):
    """from_pretrained and generate on the export, prompted through the chat template saved with it, give the
    answers the run showed at its last evaluation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from app.data.text import load_splits
    out, exported, _ = learnt
    model, tokenizer = AutoModelForCausalLM.from_pretrained(exported).eval(), AutoTokenizer.from_pretrained(exported)
    shown = [json.loads(line) for line in (out / "answers" / "step00000060.jsonl").read_text().splitlines()]
    _, held = load_splits(str(out.parent / "chats.jsonl"), "", "", 0.1, seed=42)
    for row, said in zip(held, shown):
        prompt = tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
        assert prompt == said["prompt"], "the template the run learnt went with the model"
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            made = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
        assert tokenizer.decode(made[0, ids.shape[1]:], skip_special_tokens=True) == said["answer"], said


def test_a_model_whose_packed_rows_would_see_each_other_is_refused_in_one_line(tmp_path):
    """OpenAI GPT ignores where packed rows start; the check at start says so before training."""
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel
    from app.data.tokenizers import byte_tokenizer
    from app.tools.instructions import write
    from conftest import assert_one_error_line, train_command
    torch.manual_seed(0)
    OpenAIGPTLMHeadModel(OpenAIGPTConfig(vocab_size=320, n_positions=128, n_embd=64, n_layer=1, n_head=2)
                         ).save_pretrained(tmp_path / "gpt")
    byte_tokenizer().save_pretrained(tmp_path / "gpt")
    result = run(train_command("python", 1, "--model", tmp_path / "gpt", "--dataset", write(tmp_path, 40, 0),
                               "--max_steps", 1, "--output_dir", tmp_path / "run"))
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert_one_error_line(result.stdout + result.stderr, "packing: OpenAIGPTLMHeadModel with attention",
                          "lets packed rows see each other", "pass --packing off")
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_public_tool_calling_chats_train_under_zero3_on_two_ranks(tmp_path):
    """Chats with tool calls and results from public files (tests/data/tools) on a 1-layer Llama that reads 1,024
    positions; the file whose turns hold reasoning and calls as parts is one line."""
    from app.tools.instructions import write_model
    from conftest import assert_one_error_line, read_metrics
    model = write_model(tmp_path, seed=0, layers=1)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))  # RoPE: same weights
    files = sorted((REPO / "tests" / "data" / "tools").glob("*.jsonl"))
    refused = [path.stem.endswith("-parts") for path in files]
    jobs = [["--model", model, "--dataset", path, "--deepspeed_config", REPO / "ds_configs" / "zero3.json",
             "--max_steps", 4, "--log_interval", 1, "--block_size", 1024, "--eval_fraction", 0.25, "--eval_answers", 0,
             "--output_dir", tmp_path / path.stem] for path in files]
    outputs = train_jobs("ranks", 2, jobs, codes=[2 if r else 0 for r in refused])
    for path, output, refuse in zip(files, outputs, refused):
        if refuse:
            assert_one_error_line(output, "holds parts of type reasoning", "only text parts")
            continue
        train, held = read_metrics(tmp_path / path.stem)
        assert len(train) == 4 and all(r["loss"] == r["loss"] for r in train + held), (path.name, train)
        assert "rows (" in output and "ZeRO stage 3" in output
