"""Offload to NVMe (ZeRO-Infinity) for real on 2 CPU ranks: DeepSpeed's async_io op swaps each rank's optimizer
state and weights through a folder, and the run trains the losses of the same config offloaded to the CPU, step by
step, and resumes exactly, whether its optimizer state or its weights alone went there. A machine that cannot build
the op (no libaio) is one line before any engine."""
import json
import os

import pytest
import torch

from app.memory import nvme
from conftest import (REPO, assert_one_error_line, read_metrics, run, tmpfs, train_command, train_jobs,
                      write_text_rows)

BUILDABLE = pytest.mark.skipif(not nvme.async_io_buildable(),
                               reason=f"offload to NVMe needs {nvme.LIBAIO}: `sudo make cluster-packages` installs it")


def nvme_config(folder, swap, sections=("offload_optimizer", "offload_param"), pipelined=False, **zero) -> str:
    """ds_configs/zero3_offload.json with these sections offloaded to swap in place of the CPU (the optimizer's
    swapper pipelined: pipeline_read, pipeline_write), and these zero_optimization settings."""
    ds = json.loads((REPO / "ds_configs" / "zero3_offload.json").read_text())
    ds["zero_optimization"].update(zero)
    # the weights' pinned swap buffers sized for gpt2-tiny's largest weight, not DeepSpeed's 1e8 elements (400 MB
    # each, 5 a rank): each job's engine keeps them pinned to the end of the process that runs the jobs
    for section in sections:
        ds["zero_optimization"][section] = {"device": "nvme", "nvme_path": str(swap), "pin_memory": True,
                                            **({"buffer_size": 3_000_000} if section == "offload_param" else {}),
                                            **({"pipeline_read": True, "pipeline_write": True}
                                               if pipelined and section == "offload_optimizer" else {})}
    path = folder / f"nvme-{swap.name}.json"
    path.write_text(json.dumps(ds))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (output folder, rank 0's output)} of 6 steps of gpt2-tiny on 2 ranks (its 2.6M-parameter partitions
    are past DeepSpeed's 1 MiB least swap) offloaded to the CPU, to NVMe, and with its weights alone to NVMe, saving
    at 3, and of the NVMe runs resumed from their step 3 into folders of their own (each job numbers its parameters
    as a process of its own would: tests/helpers/jobs.py); "swap": the NVMe folder. With both on NVMe,
    `sub_group_size` 1000 makes each parameter's partition a sub-group of its own: the embedding's is swapped, the
    LayerNorms' (below DeepSpeed's 1 MiB least swap) stay in memory, and a resume must restore both kinds; the same
    with the optimizer's swapper pipelined ("pipelined", whose swapper leaves the swapped moments in memory, so its
    checkpoints hold them whole, and which runs out of buffers in 0.19.8 with more than one swapped sub-group);
    last, "cpu-to-nvme": the CPU run's step 3 resumed with its optimizer state on NVMe, refused in one line."""
    tmp = tmp_path_factory.mktemp("nvme")
    corpus = write_text_rows(tmp / "corpus.txt", 400)
    both = nvme_config(tmp, tmp / "swap", sub_group_size=1000)
    weights = nvme_config(tmp, tmp / "swap-weights", ("offload_param",))
    pipelined = nvme_config(tmp, tmp / "swap-pipelined", pipelined=True, sub_group_size=1000)
    steps = ["--model", "gpt2-tiny", "--dataset", corpus, "--block_size", 64, "--max_steps", 6, "--log_interval", 1,
             "--save_interval", 3, "--eval_interval", 6]
    jobs = {"cpu": [REPO / "ds_configs" / "zero3_offload.json"], "nvme": [both], "weights": [weights],
            "pipelined": [pipelined],
            **{f"{name}-resumed": [config, "--resume", tmp / name / "checkpoints" / "step00000003"]
               for name, config in (("nvme", both), ("weights", weights), ("pipelined", pipelined))},
            "cpu-to-nvme": [both, "--resume", tmp / "cpu" / "checkpoints" / "step00000003"]}  # refused: last
    outputs = train_jobs("ranks", 2, [["--deepspeed_config", config, *steps, *rest, "--output_dir", tmp / name]
                                      for name, (config, *rest) in jobs.items()],
                         codes=[2 if name == "cpu-to-nvme" else 0 for name in jobs])
    return {"swap": tmp / "swap", **{name: (tmp / name, output) for name, output in zip(jobs, outputs)}}


def _losses(runs, name) -> dict:
    return {int(row["step"]): row["loss"] for row in read_metrics(runs[name][0])[0]}


@BUILDABLE
def test_offload_to_nvme_trains_the_losses_of_offload_to_the_cpu_swapping_through_each_ranks_folder(runs):
    cpu = _losses(runs, "cpu")
    for name in ("nvme", "weights"):
        swapped = _losses(runs, name)
        assert sorted(swapped) == sorted(cpu) == list(range(1, 7)), swapped
        assert max(abs(cpu[s] - swapped[s]) for s in cpu) < 1e-6, (name, cpu, swapped)
    kept = runs["nvme"][0] / "checkpoints" / "step00000003" / "offloaded_tensors"
    for r in (0, 1):  # what each rank had swapped out, copied into the checkpoint: the state, its moments
        assert {p.name.split("-")[0] for p in (kept / f"rank{r:02d}").glob("*.tensor.swp")} >= {"exp_avg",
                                                                                               "exp_avg_sq"}
        assert list((runs["swap"] / "zero_stage_3" / "float32params" / f"rank{r}").glob("*.tensor.swp"))


@BUILDABLE
@pytest.mark.parametrize("name", ["nvme", "weights", "pipelined"])
def test_a_run_offloaded_to_nvme_resumes_exactly(runs, name):
    """Stock DeepSpeed 0.19.8 restores the weights alone of a run whose optimizer went to NVMe: Adam's step counts
    and moments start afresh, and the partitions kept in memory keep weights it never restored (app/ds/internals/
    adam_state.py: restore_swapped_adam). The moments the resumed run swapped out at step 6 are the unbroken run's,
    byte for byte: swapped back in and out, not kept in memory."""
    whole, resumed = _losses(runs, name), _losses(runs, f"{name}-resumed")
    assert sorted(resumed) == [4, 5, 6] and all(abs(resumed[s] - whole[s]) < 1e-6 for s in resumed), (whole, resumed)
    moments = {run: {p.relative_to(runs[run][0]): p.read_bytes() for p in (runs[run][0] / "checkpoints" /
                     "step00000006" / "offloaded_tensors").glob("rank*/exp_avg*.tensor.swp")}
               for run in (name, f"{name}-resumed")}
    assert moments[name] == moments[f"{name}-resumed"] and (len(moments[name]) == 4) == (name != "weights")
    if name == "nvme":  # both kinds of partition were there to restore: moments swapped out, and moments held
        saved = torch.load(runs[name][0] / "checkpoints" / "step00000003" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                           weights_only=False)["optimizer_state_dict"]["optimizer_state_dict"]["state"].values()
        assert {state["exp_avg"].numel() > 0 for state in saved} == {True, False}


def test_a_machine_that_cannot_build_the_async_io_op_is_one_line_before_any_engine(tmp_path):
    """No libaio, as a C compiler that finds nothing says it to DeepSpeed's check (or as it is, where it is
    missing)."""
    result = run(train_command("python", 1, "--deepspeed_config", nvme_config(tmp_path, tmp_path / "swap"),
                               "--max_steps", 2, "--output_dir", tmp_path / "run"), CC="/bin/false")
    assert result.returncode == 2
    assert_one_error_line(result.stderr, "offload to NVMe needs DeepSpeed's async_io op, which builds against libaio",
                          "install it, or offload to \"cpu\"")
    assert not (tmp_path / "run").exists()


@BUILDABLE
def test_an_optimizer_state_on_nvme_resumed_on_another_world_size_is_one_line(runs, tmp_path):
    """DeepSpeed's conversion to a universal checkpoint reads the optimizer's own files, where each swapped moment
    is empty: it would fail on a shape, so the run says what cannot be done first."""
    tmp, saved = runs["swap"].parent, runs["nvme"][0] / "checkpoints" / "step00000003"
    result = run(train_command("python", 1, "--deepspeed_config", tmp / "nvme-swap.json", "--model", "gpt2-tiny",
                               "--dataset", tmp / "corpus.txt", "--block_size", 64, "--max_steps", 6,
                               "--resume", saved, "--output_dir", tmp_path / "run"))
    assert result.returncode == 2
    assert_one_error_line(result.stderr, f"checkpoint {saved} was saved by 2 rank(s) with the optimizer state on "
                          "nvme, and this run has 1 with it on nvme", "resume with the ranks and offload_optimizer.")
    assert not (saved.parent / "universal").exists()


@BUILDABLE
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs, which needs root (CI runs as root)")
def test_a_first_save_counts_the_state_swapped_to_nvme(tmp_path):
    """gpt2-tiny on 1 rank saves about 64 MB, almost all of it the swapped masters and moments its offloaded_tensors
    copy (in memory they are empty): on a 40 MB disk the first save is refused before it writes, not cut short."""
    with tmpfs(tmp_path / "small", "40m") as small:
        result = run(train_command("python", 1, "--deepspeed_config", nvme_config(tmp_path, tmp_path / "swap"),
                                   "--model", "gpt2-tiny", "--dataset", write_text_rows(tmp_path / "c.txt", 100),
                                   "--block_size", 64, "--max_steps", 1, "--save_interval", 1,
                                   "--output_dir", small / "run"))
        assert result.returncode == 2
        assert_one_error_line(result.stderr, "not enough space to save a checkpoint", "MB are free")
        assert not (small / "run" / "checkpoints").exists()


@BUILDABLE
def test_an_optimizer_state_moved_onto_nvme_at_a_resume_is_one_line(runs):
    """DeepSpeed would look for swap files the CPU-offloaded run never wrote (a FileNotFoundError in its load)."""
    folder, output = runs["cpu-to-nvme"]
    saved = runs["cpu"][0] / "checkpoints" / "step00000003"
    assert_one_error_line(output, f"checkpoint {saved} was saved by 2 rank(s) with the optimizer state on cpu, and "
                          "this run has 2 with it on nvme")
    assert not (folder / "checkpoints").exists()
