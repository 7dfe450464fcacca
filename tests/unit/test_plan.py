"""The memory plan: DeepSpeed's layout of model states worked out from parameter sizes, activations counted on fake
tensors as on real ones, the largest micro batch, and the plan command's table, recommendation and one-line
mistakes. (Its model states against a real engine's: tests/e2e/test_tools_bench.py.)"""
import pytest
import torch

from app.memory import plan
from app.tools import plan as plan_tool

CNN = [288, 32, 18432, 64, 131072, 128, 1280, 10]  # the digits CNN's parameters, in order: 151,306


def test_zero_1_and_2_keep_the_gradients_their_partition_touches_and_an_fp32_master_partition():
    device, host = plan.model_states(CNN, {"zero_optimization": {"stage": 1}}, ranks=2)
    part = 75654  # half of 151,306, rounded up to a whole number of pairs
    # rank 0's half ends inside the first linear layer's weight (131,072 elements), whose gradient it keeps whole
    assert device == {"weights": 4 * 151306, "gradients": 4 * (288 + 32 + 18432 + 64 + 131072),
                      "optimizer": 8 * part, "masters": 4 * part} and host == {}


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


@pytest.mark.parametrize("checkpointed", [False, True])
def test_fake_tensors_count_the_activation_bytes_real_ones_hold(checkpointed):
    """No weight allocated, the same count: the plan measures a 7B model on a laptop."""
    from app.core.tasks import next_token_loss
    torch.manual_seed(0)

    def inputs(b):
        ids = torch.randint(8000, (b, 64))
        return [ids], ids
    counted = [plan.activation_bytes(_tiny_gpt, inputs, next_token_loss, 2, torch.bfloat16, checkpointed, fake=fake)
               for fake in (True, False)]
    assert counted[0] == counted[1] > 0


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
    assert "not planned: bf16" in out
