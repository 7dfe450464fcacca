"""No training step waits on the device: host synchronisations counted per step (tests/helpers/host_syncs.py), the
app's and DeepSpeed's, for every shipped ds_config in the precision it takes on a GPU (bf16), eager and compiled,
on 1 and 2 ranks."""
import pytest

from conftest import write_text_rows
from helpers.host_syncs import check_report, count_in_launch, counted, sync_job

# bf16.json is dp.json with bf16 autocast on everywhere: as a GPU resolves them, the same run, counted once
CONFIGS = ("dp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "activation_checkpointing")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_text_rows(tmp_path_factory.mktemp("text") / "corpus.txt", 600)


def test_no_step_waits_on_the_device_with_two_ranks(tmp_path, corpus):
    names = [(name, mode) for mode in ("off", "on") for name in CONFIGS + ("pipeline",)
             if not (name == "pipeline" and mode == "on")]  # pipeline stages run eager
    jobs = [sync_job(name, mode, tmp_path / f"{name}-{mode}") for name, mode in names]
    llama = ["--model", "llama-tiny", "--dataset", corpus, "--block_size", 32]
    jobs += [sync_job("tensor_parallel", mode, tmp_path / f"tp-{mode}", *llama) for mode in ("off", "on")]
    reports = count_in_launch(2, jobs)
    for (name, mode), report in zip(names, reports):
        assert "precision: bf16 autocast" in report["output"], report["output"][-2000:]
        assert ("compile: compiling" in report["output"]) == (mode == "on")
        check_report(name, report)
    eager, compiled = reports[-2:]
    check_report("tensor_parallel", compiled)
    # eager, transformers' own masking code asks once per forward whether the rows are packed sequences
    model_only = {source.split(" at ")[1].split(":")[0] for _, _, source, _ in counted(eager)}
    assert model_only == {"transformers/masking_utils.py"}, counted(eager)
    assert all(count == 1 for _, _, _, count in counted(eager))


def test_no_step_waits_on_the_device_with_one_rank(tmp_path):
    names = [(name, mode) for mode in ("off", "on") for name in CONFIGS]
    reports = count_in_launch(1, [sync_job(name, mode, tmp_path / f"{name}-{mode}") for name, mode in names])
    for (name, mode), report in zip(names, reports):
        check_report(name, report)
