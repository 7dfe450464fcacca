"""DeepSpeed's checkpoint files loaded as data, never as code (app/ds/internals/safe_load.py)."""
import os
import pickle

import pytest
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from app.ds.internals import safe_load
from app.errors import UserError


class Payload:
    """Pickled as a call of os.system: loading it as a pickle creates the file."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class Harmless:
    """A class of the user's own: no code in it, but not one a checkpoint of DeepSpeed's holds."""


def _zero_optimizer_state() -> dict:
    """What a ZeRO 1-3 optimizer file holds besides tensors and plain values."""
    return {"loss_scaler": LossScaler(1.0), "dynamic_loss_scaler": DynamicLossScaler(2.0**16, 1000, 1, 2, False),
            "zero_stage": ZeroStageEnum(2), "param_slice_mappings": [{"w": fragment_address(numel=4, start=2)}],
            "state": {0: {"exp_avg": torch.ones(4), "step": torch.tensor(3.0)}}}


@pytest.fixture(autouse=True)
def force_switch_as_found(monkeypatch):
    """The tests leave torch's switch and its allowed classes as they found them."""
    monkeypatch.setenv(safe_load.FORCE, "0")
    allowed = torch.serialization.get_safe_globals()
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(allowed)


def test_deepspeeds_own_unsafe_load_of_a_file_carrying_code_is_one_line_and_nothing_runs(tmp_path):
    marker, path = tmp_path / "the-pickle-ran", tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Payload(marker)}, path)
    with pytest.raises(UserError) as caught, safe_load.data_only(f"a file under {tmp_path}"):
        torch.load(path, map_location="cpu", weights_only=False)  # as DeepSpeed 0.19.8 loads its files
    assert str(caught.value) == (f"a file under {tmp_path} is not a file of tensors and plain values (it names "
                                 f"posix.system): a checkpoint file that can carry code is not loaded, and nothing "
                                 f"of it ran; resume or export only checkpoints you made")
    assert not marker.exists()


def test_the_classes_deepspeeds_zero_files_hold_load_as_they_were_saved(tmp_path):
    torch.save(_zero_optimizer_state(), tmp_path / "optim_states.pt")
    with safe_load.data_only(tmp_path):
        loaded = torch.load(tmp_path / "optim_states.pt", weights_only=False)
    assert loaded["zero_stage"] is ZeroStageEnum.gradients and loaded["loss_scaler"].cur_scale == 1.0
    assert vars(loaded["dynamic_loss_scaler"]) == vars(_zero_optimizer_state()["dynamic_loss_scaler"])
    assert loaded["param_slice_mappings"] == [{"w": fragment_address(numel=4, start=2)}]
    assert torch.equal(loaded["state"][0]["exp_avg"], torch.ones(4))


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_the_switch_is_as_it_was_after_the_block_whether_it_loaded_or_refused(tmp_path, monkeypatch, before):
    if before is None:
        monkeypatch.delenv(safe_load.FORCE)
    else:
        monkeypatch.setenv(safe_load.FORCE, before)
    torch.save({"w": Payload(tmp_path / "ran")}, tmp_path / "bad.pt")
    with safe_load.data_only(tmp_path):
        assert os.environ[safe_load.FORCE] == "1"
    with pytest.raises(UserError), safe_load.data_only(tmp_path):
        torch.load(tmp_path / "bad.pt", weights_only=False)
    assert os.environ.get(safe_load.FORCE) == before
    assert ZeroStageEnum not in torch.serialization.get_safe_globals(), "allowed outside the block"


def test_a_folder_is_checked_file_by_file_down_its_tree_and_the_first_that_holds_more_is_named(tmp_path):
    torch.save({"module": {"w": torch.ones(2)}}, tmp_path / "mp_rank_00_model_states.pt")
    torch.save(_zero_optimizer_state(), tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "global_step4").mkdir()
    safe_load.check_files(tmp_path)
    crafted = tmp_path / "global_step4" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Harmless()}, crafted)
    with pytest.raises(UserError, match=rf"^{crafted} is not a file of tensors and plain values \(it names "
                                        rf"{__name__}.Harmless\)"):
        safe_load.check_files(tmp_path)


def test_a_plain_pickle_carrying_code_is_refused_too(tmp_path):
    marker = tmp_path / "the-pickle-ran"
    with open(tmp_path / "old.pt", "wb") as f:
        pickle.dump(Payload(marker), f, protocol=2)
    with pytest.raises(UserError, match=r"old.pt is not a file of tensors and plain values \(it names posix.system\)"):
        safe_load.check_files(tmp_path)
    assert not marker.exists()


def test_a_process_that_only_converts_checkpoints_loads_data_only_everywhere(tmp_path):
    torch.save({"w": Payload(tmp_path / "ran")}, tmp_path / "bad.pt")
    torch.save(_zero_optimizer_state(), tmp_path / "good.pt")
    safe_load.enforce_in_this_process()
    assert torch.load(tmp_path / "good.pt", weights_only=False)["zero_stage"] is ZeroStageEnum.gradients
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "bad.pt", weights_only=False)
    assert not (tmp_path / "ran").exists()
