"""The memory estimate: DeepSpeed's layout of model states worked out from parameter sizes, activations counted on fake
tensors as on real ones, the largest micro batch. (Its model states against a real engine's:
tests/e2e/test_tools_bench.py; the plan command: test_tools_plan.py.)"""
import pytest
import torch

from app.memory import estimate

CNN = [288, 32, 18432, 64, 131072, 128, 1280, 10]  # the digits CNN's parameters, in order: 151,306


def test_zero_2_keeps_the_gradients_its_partition_touches_and_an_fp32_master_partition():
    device, host = estimate.model_states(CNN, {"zero_optimization": {"stage": 2}}, ranks=2)
    part = 75654  # half of 151,306, rounded up to a whole number of pairs
    # rank 0's half ends inside the first linear layer's weight (131,072 elements), whose gradient it keeps whole
    assert device == {"weights": 4 * 151306, "gradients": 4 * (288 + 32 + 18432 + 64 + 131072),
                      "optimizer": 8 * part, "masters": 4 * part} and host == {}


def test_zero_1_keeps_every_gradient_until_the_step_unless_overlap_comm_reduces_them_as_they_arrive():
    whole = estimate.model_states(CNN, {"zero_optimization": {"stage": 1}}, ranks=2)[0]
    assert whole["gradients"] == 4 * 151306 and whole["optimizer"] == 8 * 75654
    overlap = {"zero_optimization": {"stage": 1, "overlap_comm": True}, "gradient_accumulation_steps": 1}
    assert estimate.model_states(CNN, overlap, ranks=2)[0] == estimate.model_states(
        CNN, {"zero_optimization": {"stage": 2}}, ranks=2)[0]
    # accumulating, the micro steps between boundaries keep every gradient whole
    assert estimate.model_states(CNN, {**overlap, "gradient_accumulation_steps": 4}, ranks=2)[0] == whole


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
    held = sum(estimate.model_states(sizes, ds, ranks)[0].values())
    assert held == pytest.approx(formula, rel=0.05) and held / 1e9 == pytest.approx(paper_gb, rel=0.05)


def test_lora_frozen_weights_have_no_gradient_optimizer_state_nor_master():
    trains = [i % 2 == 1 for i in range(len(CNN))]  # the biases alone train: 32 + 64 + 128 + 10 = 234 elements
    learnt = 234
    ds0 = {"bf16": {"enabled": True}}
    assert estimate.model_states(CNN, ds0, 1, trains)[0] == {"weights": 2 * 151306, "gradients": 2 * learnt,
                                                          "optimizer": 8 * learnt, "masters": 4 * learnt}
    zero1 = estimate.model_states(CNN, {**ds0, "zero_optimization": {"stage": 1}}, 2, trains)[0]
    assert zero1 == {"weights": 2 * 151306, "gradients": 2 * learnt, "optimizer": 8 * 118, "masters": 4 * 118}
    zero3 = estimate.model_states(CNN, {**ds0, "zero_optimization": {"stage": 3}}, 2, trains)[0]
    assert zero3["weights"] == 2 * sum(-(-size // 2) for size in CNN) and zero3["gradients"] == 2 * learnt // 2


def test_zero_3_partitions_each_parameter_and_offload_moves_state_to_the_host():
    zero3 = {"zero_optimization": {"stage": 3}}
    part = sum(-(-size // 2) for size in CNN)  # 75,653: each parameter split on its own
    device, host = estimate.model_states(CNN, zero3, ranks=2)
    assert device == {"weights": 4 * part, "gradients": 4 * part, "optimizer": 8 * part, "masters": 4 * part}
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                     "offload_param": {"device": "cpu"}}}
    device, host = estimate.model_states(CNN, offload, ranks=2)
    assert device == {"gradients": 0} and host == {"optimizer": 8 * part, "masters": 4 * part,
                                                    "gradients": (4 + 4) * part, "weights": 4 * part}, \
        "24 bytes a parameter: the masters' fp32 gradient and the flat partition in the weights' dtype"


def test_zero_0_holds_everything_and_bf16_weights_add_an_fp32_master():
    assert estimate.model_states(CNN, {}, ranks=8)[0] == {"weights": 4 * 151306, "gradients": 4 * 151306,
                                                        "optimizer": 8 * 151306, "masters": 0}
    bf16 = estimate.model_states(CNN, {"bf16": {"enabled": True}}, ranks=1)[0]
    assert bf16["weights"] == bf16["gradients"] == 2 * 151306 and bf16["masters"] == 4 * 151306


def test_the_largest_micro_batch_is_what_the_usable_memory_leaves():
    p = estimate.MemoryPlan("dp", 10, {"weights": 40 * 2**30}, {}, per_sample=2**30, fixed=2**30)
    assert p.peak(8) == 49 * 2**30
    assert p.largest_micro(80 * 2**30) == int((0.92 * 80 - 41) // 1)  # 32 samples of 1 GiB
    assert estimate.MemoryPlan("x", 1, {"weights": 90 * 2**30}, per_sample=1).largest_micro(80 * 2**30) == 0


def test_sampling_before_the_training_forward_peaks_on_its_own_and_bounds_the_micro_batch():
    """Online RL samples first, its cache freed before the forward: the peak is the larger of the two, and the
    largest micro batch the one both fit."""
    p = estimate.MemoryPlan("z3", 10, {"weights": 40 * 2**30}, {}, per_sample=2**30, fixed=2**30,
                            sampling=(4 * 2**30, 2 * 2**30))
    assert p.peak(1) == 46 * 2**30, "4 GiB gathered and 2 GiB of cache above the 2 GiB a sample's forward takes"
    assert p.peak(8) == (40 + 4 + 16) * 2**30
    assert p.largest_micro(80 * 2**30) == int((0.92 * 80 - 44) // 2)  # the cache at 2 GiB a sample bounds it
    assert estimate.MemoryPlan("z3", 10, {"weights": 40 * 2**30}, per_sample=2**30, fixed=2**30,
                               sampling=(40 * 2**30, 1)).largest_micro(80 * 2**30) == 0, "the gather does not fit"


def test_nvme_offload_keeps_the_flat_gradient_partition_in_host_memory_under_zero3_and_all_of_it_under_zero2():
    """ZeRO-3 swaps the optimizer state, the fp32 masters and their gradients to NVMe (and the weights with
    offload_param on NVMe): its flat gradient partition stays in host memory. ZeRO 1-2 take any offload device for
    the CPU: NVMe keeps there what the CPU does."""
    nvme = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local"},
                                  "offload_param": {"device": "nvme", "nvme_path": "/local"}}}
    device, host = estimate.model_states(CNN, nvme, ranks=2)
    part = sum(-(-size // 2) for size in CNN)
    assert device == {"gradients": 0} and sum(host.values()) == host["gradients"] == 4 * part
    assert estimate.offloads(nvme) == ("nvme", "nvme") and estimate.offloads({}) == ("", "")
    zero2 = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/local"}}}
    cpu = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert estimate.model_states(CNN, zero2, ranks=2) == estimate.model_states(CNN, cpu, ranks=2)


def test_zero3s_partial_offload_moves_the_last_sub_groups_optimizer_to_the_host():
    """offload_optimizer's ratio (ZeRO-3) offloads the last of the rank's sub-groups, as many as it gives; a
    sub-group closes at the parameter that brings it to sub_group_size elements: 4 parameters of 100 in sub-groups of
    100 at 0.5, 2 on the host and 2 on the GPU (their fp32 gradients too); one sub-group goes whole at any ratio."""
    ds = {"zero_optimization": {"stage": 3, "sub_group_size": 100, "offload_optimizer": {"device": "cpu",
                                                                                         "ratio": 0.5}}}
    device, host = estimate.model_states([100] * 4, ds, ranks=1)
    assert (host["optimizer"], host["masters"], host["gradients"]) == (8 * 200, 4 * 200, 4 * 200 + 4 * 400)
    assert (device["optimizer"], device["masters"], device["gradients"]) == (8 * 200, 4 * 200, 4 * 200)
    assert estimate.offloaded_share({"sub_group_size": 100, "offload_optimizer": {"ratio": 0.5}}, [400]) == 400
    assert estimate.offloaded_share({"sub_group_size": 150, "offload_optimizer": {"ratio": 0.5}}, [100] * 4) == 200


def test_zero1_with_offload_keeps_every_gradient_whole_on_the_gpu_until_the_boundary_zero2_only_a_staging_one():
    """DeepSpeed's stage 1 without overlap_comm reduces (and copies to the host) at the accumulation boundary: its
    gradients stay whole on the GPU until then, beside the staging buffer of the largest parameter; stage 2 reduces
    each as it arrives and keeps the staging buffer alone."""
    offload = {"offload_optimizer": {"device": "cpu"}}
    zero1 = estimate.model_states(CNN, {"zero_optimization": {"stage": 1, **offload}}, ranks=2)[0]
    zero2 = estimate.model_states(CNN, {"zero_optimization": {"stage": 2, **offload}}, ranks=2)[0]
    assert zero1["gradients"] == 4 * (max(CNN) + sum(CNN)) and zero2["gradients"] == 4 * max(CNN)


def test_zero_0_to_2_free_their_gradients_at_the_step_and_the_step_copies_them():
    """ZeRO 0-2 make their gradients in the backward and free them, and their buckets, at the step: the forward's
    peak does not hold them, unless accumulation keeps the gradients for the next micro batch. The step adds its
    copies: 16-bit gradients in fp32 (ZeRO 0), ZeRO's fp64 norm of one gradient, the flat partition in the
    weights' dtype then fp32; ZeRO-3 keeps its gradient partition; offload keeps everything as it was planned."""
    n, largest = sum(CNN), max(CNN)
    dp = estimate.model_states(CNN, {}, 1)[0]
    rest = 4 * (n - largest)  # the largest gradient counts beside the activations
    assert estimate.between_steps(CNN, {}, 1, dp) == (rest, rest)
    bf16 = {"bf16": {"enabled": True}}
    fused = {**bf16, "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "fused": True}}}
    sixteen = estimate.model_states(CNN, bf16, 1)[0]
    assert estimate.between_steps(CNN, fused, 1, sixteen) == (2 * (n - largest), 4 * n), \
        "the app's step: each gradient's fp32 copy, the 16-bit one freed as it is made"
    unfused = {**bf16, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    assert estimate.between_steps(CNN, unfused, 1, sixteen) == (2 * (n - largest), 2 * n + 4 * n - 2 * largest)
    assert estimate.between_steps(CNN, bf16, 1, sixteen) == (2 * (n - largest), 2 * n + 8 * n - 2 * largest), \
        "DeepSpeed's FusedAdam: FP16_Optimizer copies each gradient to fp32, then all of them flat"
    zero2 = {"zero_optimization": {"stage": 2}}
    device = {**estimate.model_states(CNN, zero2, 1)[0], "working": 1000}
    assert estimate.between_steps(CNN, zero2, 1, device) == (rest + 1000, rest + 1000 + max(8 * largest, 4 * n))
    even = [1000] * 8  # on 8 ranks each touches one; a compiled backward makes all 8 whole at once
    on_eight = {**estimate.model_states(even, zero2, 8)[0], "working": 1000}
    # its flush: the bucket (8000 elements: the app's cap) copied flat beside it and the partition's gradient, less
    # the first gradient, which the activations' count holds; ZeRO-1 moves its gradients into the bucket instead
    assert on_eight["gradients"] == 4 * 1000 and estimate.between_steps(even, zero2, 8, on_eight)[1] == \
        4 * 1000 + 1000 + 4 * 8000 - 4 * 1000
    zero1 = {"zero_optimization": {"stage": 1}}
    whole = {**on_eight, "gradients": 4 * 8000}  # ZeRO-1's: every gradient until the step; its norm's fp64 copy
    assert estimate.between_steps(even, zero1, 8, whole)[1] == 4 * 8000 + 1000 + 8 * 1000 - 4000
    accumulated = {**zero2, "gradient_accumulation_steps": 2}  # the partition's held through the forward, beside them
    assert estimate.between_steps(even, accumulated, 8, on_eight) == (1000, 4 * 8000 + 1000)
    assert estimate.between_steps(CNN, {"gradient_accumulation_steps": 2}, 1, dp) == (0, 4 * n)
    zero3 = {"zero_optimization": {"stage": 3, "sub_group_size": 10_000}}
    groups = estimate.sub_groups(zero3["zero_optimization"], [-(-size // 2) for size in CNN])
    assert sum(groups) == sum(-(-size // 2) for size in CNN) and len(groups) > 1
    assert estimate.between_steps(CNN, {**zero3, **bf16}, 2, {}) == (0, max(8 * -(-largest // 2), 6 * max(groups)))
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert estimate.between_steps(CNN, offload, 1, estimate.model_states(CNN, offload, 1)[0]) == (0, 0)
    weights_away = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert estimate.between_steps(CNN, weights_away, 1, {})[1] == max(8 * largest, 4 * n), "the step copies on the GPU"


def test_the_peak_is_the_forwards_states_and_the_larger_of_the_activations_and_the_steps_bytes():
    p = estimate.MemoryPlan("dp", 10, {"weights": 40 * 2**30, "gradients": 8 * 2**30}, per_sample=2**30,
                            freed=8 * 2**30, after=12 * 2**30)
    assert p.peak(4) == (40 + 12) * 2**30, "4 samples' activations under the step's 12 GiB"
    assert p.peak(16) == (40 + 16) * 2**30
    assert p.largest_micro(int((40 + 11) * 2**30 / estimate.USABLE)) == 0, "the step itself does not fit"
    assert p.largest_micro(int((40 + 20) * 2**30 / estimate.USABLE) + 1) == 20
