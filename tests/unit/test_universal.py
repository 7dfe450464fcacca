"""DeepSpeed's universal conversion, every file read as data only (app/ds/internals/universal.py), in this process."""
import os
import runpy
import sys

import pytest
import torch
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum

from app.ds.internals.safe_load import FORCE
from conftest import assert_one_error_line

pytestmark = pytest.mark.filterwarnings("ignore:'deepspeed.checkpoint.ds_to_universal' found in sys.modules")


class Payload:
    """Pickled as a call of os.system: loading it as a pickle creates the file."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def convert(monkeypatch):
    """Runs the module as its __main__ with these arguments; the process's load switch and allowed classes are put
    back afterwards."""
    monkeypatch.setenv(FORCE, "0")
    allowed = torch.serialization.get_safe_globals()

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["universal", *map(str, args)])
        runpy.run_module("app.ds.internals.universal", run_name="__main__")
    yield run
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(allowed)


def test_a_zero_file_carrying_code_ends_the_conversion_in_one_line_naming_the_folder(convert, tmp_path, capsys):
    """The last line of its stderr is what a resume on another world size tells the user."""
    marker = tmp_path / "the-pickle-ran"
    torch.save({"optimizer_state_dict": Payload(marker)}, tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(SystemExit) as caught:
        convert("--input_folder", tmp_path, "--output_folder", tmp_path / "universal", "--num_extract_workers", 1)
    assert caught.value.code == 1 and not marker.exists()
    stderr = capsys.readouterr().err
    assert_one_error_line(stderr, f"error: a file under {tmp_path} is not a file of tensors and plain values (it "
                                  f"names posix.system)", "nothing of it ran")
    assert stderr.strip().splitlines()[-1].startswith("error: ")


def test_a_zero_file_of_what_deepspeed_saves_is_read_and_the_conversion_goes_on(convert, tmp_path):
    """The stage is read from the first optimizer file; a folder without the rest fails on DeepSpeed's own check."""
    state = {"zero_stage": ZeroStageEnum(2), "loss_scaler": LossScaler(1.0), "state": {0: {"step": torch.tensor(2.0)}}}
    torch.save({"optimizer_state_dict": state}, tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(AssertionError, match="Cannot find mp_rank_\\* files"):
        convert("--input_folder", tmp_path, "--output_folder", tmp_path / "universal", "--num_extract_workers", 1)
    assert os.environ[FORCE] == "1", "the conversion's loads are data only"
