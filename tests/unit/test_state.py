"""What an engine holds and saves (app/ds/internals/state.py): storages, a ZeRO 0 folder, DeepSpeed's estimate."""
import pickle
from pathlib import PurePosixPath

import pytest
import torch

from app.ds.internals.state import deepspeed_estimate, module_states, storages


def test_views_of_one_flat_buffer_count_once_and_empty_or_missing_tensors_not_at_all():
    flat = torch.zeros(100)
    other = torch.zeros(10, dtype=torch.bfloat16)
    held = storages([flat[:40], flat[40:], flat.view(10, 10), other, torch.zeros(0), None])
    assert held == {flat.untyped_storage().data_ptr(): 400, other.untyped_storage().data_ptr(): 20}
    assert sum(storages([flat[:1]]).values()) == 400, "a slice holds its whole buffer"


def test_a_zero_0_folders_weights_are_read_from_the_file_deepspeed_names_for_them(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_model_state_file
    weights = {"layer.weight": torch.randn(3, 2), "layer.bias": torch.zeros(3)}
    torch.save({"module": weights, "buffer_names": [], "dp_world_size": 1}, tmp_path / "mp_rank_00_model_states.pt")
    assert get_model_state_file(str(tmp_path), zero_stage=0) == str(tmp_path / "mp_rank_00_model_states.pt")
    loaded = module_states(tmp_path)
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_a_zero_0_weights_file_that_holds_more_than_tensors_and_plain_values_is_refused(tmp_path):
    """Export reads it: a class in it could be code, which is never run."""
    torch.save({"module": {"w": torch.ones(1)}, "where": PurePosixPath("/x")}, tmp_path / "mp_rank_00_model_states.pt")
    with pytest.raises(pickle.UnpicklingError, match="PurePosixPath"):
        module_states(tmp_path)


MILLION, LAYER = 10**6, 10**5


@pytest.mark.parametrize("stage, offload, offload_params, gpu_bytes", [
    (0, False, False, None), (1, False, False, None), (1, True, False, None),  # DeepSpeed has no estimator for them
    (2, False, False, 2 * MILLION + 18 * MILLION // 4),  # fp16 weights whole; grads, masters and moments split
    (2, True, False, 2 * MILLION),  # offload: the fp16 weights alone stay on the GPU
    (3, False, False, 4 * LAYER + 18 * MILLION // 4),  # the largest layer gathered, the rest split
    (3, True, False, 4 * LAYER + 2 * MILLION // 4),
    (3, True, True, 4 * LAYER),
])
def test_deepspeeds_estimate_is_the_gpu_bytes_of_one_of_the_ranks(stage, offload, offload_params, gpu_bytes):
    """The memory plan prints it beside its own (the `DS est.` column): the GPU's share, not the host's, for 4 ranks."""
    assert deepspeed_estimate(stage, offload, offload_params, MILLION, LAYER, 4) == gpu_bytes
