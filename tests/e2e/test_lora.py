"""LoRA end to end: a tiny Llama folder's adapters trained on chats under ZeRO 0-3, offload and activation
checkpointing on 2 ranks; only the adapters train, are saved and resume exactly; ZeRO-3's checkpoint holds their
real values (equal to ZeRO 0's); the adapter folder and the merged model answer as the run did; the bench compares
LoRA with training the whole model."""
import json
import sys

import pytest
import torch

from conftest import REPO, read_metrics, run, train_jobs

ADAPTERS = 47_104  # rank 8 on every linear layer of the 2 blocks: 4 x 2 x 8 x (128 + 128) + 3 x 2 x 8 x (128 + 512)


def without_schedule(tmp, stage: int, checkpointed: bool = False) -> str:
    """zero3.json at another ZeRO stage, without its learning-rate schedule (a run cut in two then follows the same
    course as one run whole), with activation checkpointing when asked."""
    ds = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    ds.pop("scheduler")
    ds.update(zero_optimization={"stage": stage}, train_micro_batch_size_per_gpu=4)
    ds.update({"activation_checkpointing": {}} if checkpointed else {})
    path = tmp / f"stage{stage}{'-checkpointed' if checkpointed else ''}.json"
    path.write_text(json.dumps(ds))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch of 2 ranks: ZeRO-3 for 8 steps, the same cut at step 4 and resumed, ZeRO 0 with activation
    checkpointing for 4 steps, and a step of zero1.json and zero2_offload.json; then both exports."""
    tmp = tmp_path_factory.mktemp("lora")
    from app.tools.instructions import write, write_model
    chats, model = write(tmp, 400, seed=0), write_model(tmp, seed=0)
    common = ["--model", model, "--dataset", chats, "--lora", "--log_interval", 1, "--eval_answers", 0]
    zero3 = without_schedule(tmp, 3)
    jobs = [[*common, "--deepspeed_config", zero3, "--max_steps", 8, "--eval_interval", 4, "--output_dir",
             tmp / "whole", "--eval_answers", 3, "--answer_tokens", 16],
            [*common, "--deepspeed_config", zero3, "--max_steps", 4, "--output_dir", tmp / "cut"],
            [*common, "--deepspeed_config", zero3, "--max_steps", 8, "--eval_interval", 4, "--output_dir",
             tmp / "cut", "--resume", "auto"],
            [*common, "--deepspeed_config", without_schedule(tmp, 0, checkpointed=True), "--max_steps", 4,
             "--output_dir", tmp / "zero0"]]
    jobs += [[*common, "--deepspeed_config", REPO / "ds_configs" / f"{name}.json", "--max_steps", 1, "--output_dir",
              tmp / name] for name in ("zero1", "zero2_offload")]
    outputs = train_jobs("ranks", 2, jobs)
    for args in (["whole", "adapters"], ["whole", "merged", "--merged"]):
        result = run([sys.executable, "-m", "app.tools.export", tmp / args[0], tmp / args[1], *args[2:]])
        assert result.returncode == 0, result.stdout + result.stderr
    return tmp, model, outputs


def adapters_of(run_folder, step: int) -> dict:
    """The fp32 tensors a run's checkpoint holds, as export reads them."""
    from app.tools.export import fp32_state_dict
    return fp32_state_dict(run_folder / "checkpoints" / f"step{step:08d}")


@pytest.mark.parametrize("name", ["whole", "zero0", "zero1", "zero2_offload"])
def test_only_the_adapters_train_and_are_saved(runs, name):
    tmp, _, outputs = runs
    output = outputs[["whole", "cut", "resumed", "zero0", "zero1", "zero2_offload"].index(name)]
    assert f"LoRA: {ADAPTERS:,} adapter parameters train" in output
    steps = {"whole": 8, "zero0": 4}.get(name, 1)
    saved = adapters_of(tmp / name, steps)
    assert all(".lora_A." in key or ".lora_B." in key for key in saved), sorted(saved)[:3]
    assert sum(t.numel() for t in saved.values()) == ADAPTERS
    loss = [r["loss"] for r in read_metrics(tmp / name)[0]]
    assert all(torch.isfinite(torch.tensor(loss))), loss


def test_zero3_saves_the_real_adapter_values_those_of_zero0(runs):
    """The same 4 steps under ZeRO-3 and under ZeRO 0 (whose checkpoint keeps the module whole) end with the same
    adapters, by value; B starts at zero, so a saved zero or an empty tensor would show."""
    tmp, _, _ = runs
    zero3, zero0 = adapters_of(tmp / "cut", 4), adapters_of(tmp / "zero0", 4)
    assert zero3.keys() == zero0.keys()
    for key, value in zero0.items():
        assert zero3[key].shape == value.shape and torch.allclose(zero3[key], value, atol=1e-5), key
    assert min(value.abs().max().item() for key, value in zero3.items() if ".lora_B." in key) > 0


def test_a_run_resumed_from_its_adapters_goes_on_as_if_never_stopped(runs):
    tmp, _, outputs = runs
    assert "resume: " in outputs[2] and "at step 4" in outputs[2]
    whole, resumed = read_metrics(tmp / "whole"), read_metrics(tmp / "cut")
    assert [r["loss"] for r in whole[0]] == [r["loss"] for r in resumed[0]], "every step's loss, bit for bit"
    assert whole[1][-1]["eval_loss"] == resumed[1][-1]["eval_loss"]


@pytest.mark.parametrize("form", ["adapters", "merged"])
def test_the_exports_answer_as_the_run_did(runs, form):
    """The adapter folder loaded by peft onto the base model, and the merged transformers folder, give the greedy
    answers the run showed at its last evaluation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tmp, model_folder, _ = runs
    exported = tmp / form
    if form == "adapters":
        from peft import PeftModel
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in exported.iterdir()}
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_folder), exported)
    else:
        model = AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    shown = [json.loads(line) for line in (tmp / "whole" / "answers" / "step00000008.jsonl").read_text().splitlines()]
    assert len(shown) == 3
    model.eval()
    for said in shown:
        ids = torch.tensor([tokenizer(said["prompt"], add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            made = model.generate(input_ids=ids, max_new_tokens=16, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        assert tokenizer.decode(made[0, ids.shape[1]:], skip_special_tokens=True) == said["answer"], said


def test_adapters_resume_on_one_rank_from_a_folder_named_relative_to_where_the_user_is(runs):
    """The 2-rank zero1.json run's adapters continue on 1 rank through DeepSpeed's universal checkpoint; the run
    folder is named relative to the user's folder, not the repository."""
    tmp, model, _ = runs
    argv = [REPO / "app" / "train.py", "--model", model, "--dataset", tmp / "chats.jsonl", "--lora", "--eval_answers",
            0, "--deepspeed_config", REPO / "ds_configs" / "zero1.json", "--max_steps", 2, "--output_dir", "zero1",
            "--resume", "auto"]
    result = run([sys.executable, *argv], cwd=tmp)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "converting it to a universal checkpoint" in result.stdout
    assert "resume: zero1/checkpoints/universal/step00000001 at step 1" in result.stdout
    assert [r["step"] for r in read_metrics(tmp / "zero1")[0]] == [1, 2]
    assert sum(t.numel() for t in adapters_of(tmp / "zero1", 2).values()) == ADAPTERS


def test_the_bench_sets_lora_beside_training_the_whole_model(tmp_path):
    result = run([sys.executable, "-m", "app.tools.bench", "--model", "llama-tiny", "--modes", "app", "--configs",
                  "dp", "--ranks", "1", "--lora", "--quick", "--output_dir", tmp_path])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads((tmp_path / "bench.json").read_text())["modes"]}
    assert set(rows) == {"dp", "dp+lora"}
    lora, whole = rows["dp+lora"], rows["dp"]
    ratio = lora["tokens_per_s"] / whole["tokens_per_s"]
    assert f"dp+lora x1: LoRA trains at {ratio:.3f}x the tokens/s of the whole model" in result.stdout
    assert lora["mfu"] / lora["samples_per_s"] < whole["mfu"] / whole["samples_per_s"], "frozen weights: fewer FLOPs"
