"""The memory plan: DeepSpeed's layout of model states worked out from parameter sizes, activations counted on fake
tensors as on real ones, the largest micro batch, and the plan command's table, recommendation and one-line
mistakes. (Its model states against a real engine's: tests/e2e/test_tools_bench.py.)"""
import pytest
import torch

from app.memory import plan
from app.tools import plan as plan_tool

CNN = [288, 32, 18432, 64, 131072, 128, 1280, 10]  # the digits CNN's parameters, in order: 151,306


def test_zero_2_keeps_the_gradients_its_partition_touches_and_an_fp32_master_partition():
    device, host = plan.model_states(CNN, {"zero_optimization": {"stage": 2}}, ranks=2)
    part = 75654  # half of 151,306, rounded up to a whole number of pairs
    # rank 0's half ends inside the first linear layer's weight (131,072 elements), whose gradient it keeps whole
    assert device == {"weights": 4 * 151306, "gradients": 4 * (288 + 32 + 18432 + 64 + 131072),
                      "optimizer": 8 * part, "masters": 4 * part} and host == {}


def test_zero_1_keeps_every_gradient_until_the_step_unless_overlap_comm_reduces_them_as_they_arrive():
    whole = plan.model_states(CNN, {"zero_optimization": {"stage": 1}}, ranks=2)[0]
    assert whole["gradients"] == 4 * 151306 and whole["optimizer"] == 8 * 75654
    overlap = {"zero_optimization": {"stage": 1, "overlap_comm": True}, "gradient_accumulation_steps": 1}
    assert plan.model_states(CNN, overlap, ranks=2)[0] == plan.model_states(
        CNN, {"zero_optimization": {"stage": 2}}, ranks=2)[0]
    # accumulating, the micro steps between boundaries keep every gradient whole
    assert plan.model_states(CNN, {**overlap, "gradient_accumulation_steps": 4}, ranks=2)[0] == whole


def _gpt2_7b_sizes() -> list:
    """Parameter sizes of the ZeRO paper's 7.5B GPT-2 shape (36 layers of width 4096): 7.46B, on the meta device."""
    from transformers import GPT2Config, GPT2LMHeadModel
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=36, n_embd=4096, n_head=32, n_positions=1024, vocab_size=50257))
    return [p.numel() for p in model.parameters()]


@pytest.mark.parametrize("stage, paper_gb", [(0, 119.36), (1, 31.24), (2, 16.55), (3, 1.86)])
def test_the_model_states_agree_with_the_zero_paper_at_7b_on_64_ranks(stage, paper_gb):
    """Rajbhandari et al., Figure 1: mixed-precision Adam (K = 12) on Nd = 64 ranks holds (2+2+K)Psi,
    2Psi+2Psi+K*Psi/Nd, 2Psi+(2+K)Psi/Nd and (2+2+K)Psi/Nd bytes per rank under ZeRO 0-3."""
    sizes, ranks, k = _gpt2_7b_sizes(), 64, 12
    psi = sum(sizes)
    assert psi == pytest.approx(7.46e9, rel=0.01)
    formula = [(2 + 2 + k) * psi, 4 * psi + k * psi / ranks, 2 * psi + (2 + k) * psi / ranks,
               (2 + 2 + k) * psi / ranks][stage]
    ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
    held = sum(plan.model_states(sizes, ds, ranks)[0].values())
    assert held == pytest.approx(formula, rel=0.05) and held / 1e9 == pytest.approx(paper_gb, rel=0.05)


def test_lora_frozen_weights_have_no_gradient_optimizer_state_nor_master():
    trains = [i % 2 == 1 for i in range(len(CNN))]  # the biases alone train: 32 + 64 + 128 + 10 = 234 elements
    learnt = 234
    ds0 = {"bf16": {"enabled": True}}
    assert plan.model_states(CNN, ds0, 1, trains)[0] == {"weights": 2 * 151306, "gradients": 2 * learnt,
                                                          "optimizer": 8 * learnt, "masters": 4 * learnt}
    zero1 = plan.model_states(CNN, {**ds0, "zero_optimization": {"stage": 1}}, 2, trains)[0]
    assert zero1 == {"weights": 2 * 151306, "gradients": 2 * learnt, "optimizer": 8 * 118, "masters": 4 * 118}
    zero3 = plan.model_states(CNN, {**ds0, "zero_optimization": {"stage": 3}}, 2, trains)[0]
    assert zero3["weights"] == 2 * sum(-(-size // 2) for size in CNN) and zero3["gradients"] == 2 * learnt // 2


def test_zero_3_partitions_each_parameter_and_offload_moves_state_to_the_host():
    zero3 = {"zero_optimization": {"stage": 3}}
    part = sum(-(-size // 2) for size in CNN)  # 75,653: each parameter split on its own
    device, host = plan.model_states(CNN, zero3, ranks=2)
    assert device == {"weights": 4 * part, "gradients": 4 * part, "optimizer": 8 * part, "masters": 4 * part}
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                     "offload_param": {"device": "cpu"}}}
    device, host = plan.model_states(CNN, offload, ranks=2)
    assert device == {"gradients": 0} and host == {"optimizer": 8 * part, "masters": 4 * part,
                                                    "gradients": 4 * part, "weights": 4 * part}


def test_zero_0_holds_everything_and_bf16_weights_add_an_fp32_master():
    assert plan.model_states(CNN, {}, ranks=8)[0] == {"weights": 4 * 151306, "gradients": 4 * 151306,
                                                        "optimizer": 8 * 151306, "masters": 0}
    bf16 = plan.model_states(CNN, {"bf16": {"enabled": True}}, ranks=1)[0]
    assert bf16["weights"] == bf16["gradients"] == 2 * 151306 and bf16["masters"] == 4 * 151306


def test_the_largest_micro_batch_is_what_the_usable_memory_leaves():
    p = plan.MemoryPlan("dp", 10, {"weights": 40 * 2**30}, {}, per_sample=2**30, fixed=2**30)
    assert p.peak(8) == 49 * 2**30
    assert p.largest_micro(80 * 2**30) == int((0.92 * 80 - 41) // 1)  # 32 samples of 1 GiB
    assert plan.MemoryPlan("x", 1, {"weights": 90 * 2**30}, per_sample=1).largest_micro(80 * 2**30) == 0


def _tiny_gpt():
    from app.core import models
    from transformers import AutoModelForCausalLM
    spec = models.hf_spec("gpt2-tiny")
    return models.HFLogits(AutoModelForCausalLM.from_config(spec.config))


@pytest.mark.parametrize("checkpointed, weights16", [(False, False), (True, False), (False, True)])
def test_fake_tensors_count_the_activation_bytes_real_ones_hold(checkpointed, weights16):
    """No weight allocated, the same count: the plan measures a 7B model on a laptop."""
    from app.core.tasks import next_token_loss
    torch.manual_seed(0)

    def inputs(b):
        ids = torch.randint(8000, (b, 64))
        return [ids], ids
    counted = [plan.activation_bytes(_tiny_gpt, inputs, next_token_loss, 2, torch.bfloat16, checkpointed, fake=fake,
                                     weights16=weights16) for fake in (True, False)]
    assert counted[0] == counted[1] > 0


def test_a_view_of_a_weight_made_before_is_not_counted():
    """bf16 weights are used as they are (a linear layer takes weight.t(), a view): nothing new is held."""
    layer = torch.nn.Linear(256, 256, bias=False).requires_grad_(False)  # frozen: no gradient of its size either

    def inputs(b):
        return [torch.randn(b, 256, requires_grad=True)], torch.zeros(b, dtype=torch.long)
    held = plan.activation_bytes(lambda: layer, inputs, lambda out, y: out.sum(1), 1, None, False, fake=False)
    assert held < 256 * 256 * 4 / 2, "the weight's transpose counted as new bytes"


def test_checkpointing_holds_fewer_activations():
    from app.core.tasks import next_token_loss

    def inputs(b):
        ids = torch.randint(8000, (b, 128))
        return [ids], ids
    plain, checkpointed = (plan.activation_bytes(_tiny_gpt, inputs, next_token_loss, 4, torch.bfloat16, on)
                           for on in (False, True))
    assert checkpointed < 0.8 * plain


@pytest.mark.parametrize("text, count", [("80GB", 80e9), ("80GiB", 80 * 2**30), ("81920MiB", 80 * 2**30),
                                         ("24", 24e9), (" 1.5 TB ", 1.5e12)])
def test_memory_sizes(text, count):
    assert plan_tool.memory_size(text) == int(count)


@pytest.mark.parametrize("argv, message", [
    (["--gpu_memory", "lots"], "--gpu_memory 'lots' is not a memory size; write it like 80GB"),
    (["--gpu_memory", "0GB"], "is not a memory size"),
    ([], "no GPU here to read the memory of: pass --gpu_memory"),
    (["--gpu_memory", "8GB", "--model", "nope-9000"], "unknown model 'nope-9000'"),
])
def test_mistakes_are_one_line(argv, message, capsys):
    assert plan_tool.main(argv) == 2  # the CPU tests see no GPU (conftest hides them)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_a_config_only_folder_plans_and_the_fastest_config_that_fits_is_recommended(tmp_path, capsys):
    from app.core import models
    models.hf_spec("gpt2-tiny").config.save_pretrained(tmp_path / "gpt2")  # config.json, no weights
    assert plan_tool.main(["--model", str(tmp_path / "gpt2"), "--world_size", "2", "--micro_batch", "64",
                           "--seq_len", "128", "--gpu_memory", "1.4GB"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line.split()[0] in plan_tool.ORDER}
    assert list(rows) == list(plan_tool.ORDER), "every shipped data-parallel config, fastest first"
    assert rows["dp"][-3] == "no" and rows["activation_checkpointing"][-3] == "yes", out
    assert "recommended: activation_checkpointing" in out and "dp would peak at" in out
    assert "dp+bf16 would peak at" in out and "not planned: bf16" in out


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
    autocast, bf16 = rows[argv[-1]], rows[argv[-1] + "+bf16"]
    assert float(bf16[1]) == pytest.approx(float(autocast[1]) / 2, abs=0.01), "weights: 2 bytes, not 4"
    peaks = float(autocast[9]), float(bf16[9])
    assert peaks[1] < peaks[0] and f"recommended: {argv[-1]}," in out, "both fit: autocast, the more precise"
    memory = sum(peaks) / 2 / 0.92  # a run may use 92% of it: between the two peaks
    assert plan_tool.main([*argv, "--gpu_memory", f"{memory:.4f}GB"]) == 0
    out = capsys.readouterr().out
    assert f"recommended: {argv[-1]}+bf16" in out and "with bf16 weights in place of autocast's fp32 ones" in out
    assert f"({argv[-1]} would peak at" in out
