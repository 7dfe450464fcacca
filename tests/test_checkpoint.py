"""Checkpoints: crash-safe saves, exact resume after kills, world size changes, refusal of bad checkpoints;
and, without an engine, the TrainerState, verify, find and the resume checks on hand-written folders."""
import hashlib
import json
import subprocess

import pytest
import torch

from app import checkpoint
from app.checkpoint import MANIFEST, STATE, TrainerState
from app.errors import UserError
from app.tools.export import fp32_state_dict
from conftest import (REPO, TWO_RANK_ARGS, TWO_RANK_STEPS, assert_one_error_line, read_metrics, run, train,
                      train_command, train_jobs, two_rank_steps)


def assert_same_run(expected, got, steps=TWO_RANK_STEPS):
    """Per-step losses identical (==) and the final weights identical."""
    want, have = read_metrics(expected)[0], read_metrics(got)[0]
    assert [r["step"] for r in have] == list(range(1, steps + 1)), "metrics.csv holds each step once"
    assert [r["loss"] for r in have] == [r["loss"] for r in want], "per-step losses identical"
    final = f"checkpoints/step{steps:08d}"
    a, b = fp32_state_dict(expected / final), fp32_state_dict(got / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final weights identical"


# Where each config's run is killed with SIGKILL (APP_KILL_AT=<moment>:<step>:<rank>) and which
# checkpoint the resumed run must then start from: a save is only used once it is whole.
KILLS = {
    "dp": ("shards:20:1", 15),          # rank 1 dies right after writing its shards
    "zero1": ("manifest:20:0", 15),     # every shard written, rank 0 dies before the manifest
    "zero2": ("pointer:20:0", 20),      # manifest written, rank 0 dies before the pointer: still whole
    "zero3": ("shards:20:0", 15),       # rank 0 dies with its shards written, rank 1 waiting
    "zero2_offload": ("shards:20:1", 15),
    "pipeline": ("shards:20:1", 15),   # the last stage dies with its layer files written
}


@pytest.fixture(scope="module")
def killed_then_resumed(tmp_path_factory):
    """name -> ((exit code, complete checkpoints, latest) when killed, resumed run's stdout, output_dir): each
    config's run killed by itself, then every killed run resumed, one after another in one deepspeed launch."""
    root, killed = tmp_path_factory.mktemp("killed"), {}
    for name, (moment, _) in sorted(KILLS.items()):
        config = REPO / "ds_configs" / f"{name}.json"
        result = run(train_command("deepspeed", 2, "--deepspeed_config", config, *TWO_RANK_ARGS,
                                   "--output_dir", root / name), APP_KILL_AT=moment)
        complete = sorted(p.parent.name for p in (root / name / "checkpoints").glob("step*/manifest.json"))
        killed[name] = result.returncode, complete, (root / name / "checkpoints" / "latest").read_text()
    resumed = train_jobs("deepspeed", 2, [["--deepspeed_config", REPO / "ds_configs" / f"{name}.json", *TWO_RANK_ARGS,
                                           "--output_dir", root / name, "--resume", "auto"] for name in killed])
    return {name: (killed[name], stdout, root / name) for name, stdout in zip(killed, resumed)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(KILLS))
def test_killed_during_save_then_resumed_is_exact(name, killed_then_resumed, two_rank_run):
    """Resumed mid-epoch (step 15 or 20 of 23), the run crosses the epoch boundary exactly as the whole run did."""
    (moment, resume_step), ((code, complete, pointer), resumed, out) = KILLS[name], killed_then_resumed[name]
    assert code != 0, "the run was killed"
    assert complete[-1] == f"step{resume_step:08d}", complete
    assert pointer == ("step00000015" if moment.startswith("pointer") else complete[-1]), "latest names a whole one"
    assert f"resume: {out / 'checkpoints' / f'step{resume_step:08d}'} at step {resume_step}" in resumed
    steps = two_rank_steps(name)
    assert_same_run(two_rank_run(name)[0], out, steps)
    kept = sorted(p.name for p in (out / "checkpoints").glob("step*"))
    saved = sorted({*range(5, steps + 1, 5), steps})[-3:]
    assert kept == [f"step{s:08d}" for s in saved], "--keep_last 3"


@pytest.mark.slow
def test_half_written_checkpoints_are_cleared(tmp_path):
    """A folder left by a killed save is removed by the next whole save, not kept forever."""
    out = tmp_path / "run"
    run(train_command("python", 1, "--max_steps", 6, "--save_interval", 2, "--output_dir", out),
        APP_KILL_AT="manifest:4")
    assert (out / "checkpoints" / "step00000004").is_dir(), "the killed save left a folder"
    assert not (out / "checkpoints" / "step00000004" / "manifest.json").exists()
    train("python", 1, "--max_steps", 3, "--output_dir", out, "--resume", "auto")
    assert sorted(p.name for p in (out / "checkpoints").glob("step*")) == ["step00000002", "step00000003"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A finished 4-step run saved at steps 2 and 4, started with --resume auto on an empty folder."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    result = train("python", 1, "--max_steps", 4, "--save_interval", 2, "--output_dir", out, "--resume", "auto")
    (out.parent / "stdout.txt").write_text(result.stdout)
    return out


def _fails(result, text):
    assert result.returncode != 0, result.stderr
    assert_one_error_line(result.stderr, text)


def _copy(saved_run, tmp_path):
    copy = tmp_path / "run"
    subprocess.run(["cp", "-r", str(saved_run), str(copy)], check=True)
    return copy, {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}


def _untouched(before):
    assert all(p.read_bytes() == data for p, data in before.items()), "nothing of the run was overwritten"


@pytest.mark.slow
@pytest.mark.parametrize("damage, text", [
    ("truncate", "mp_rank_00_model_states.pt does not match its manifest"),
    ("delete", "mp_rank_00_model_states.pt is missing"),
])
def test_damaged_checkpoint_is_refused(damage, text, saved_run, tmp_path):
    damaged, _ = _copy(saved_run, tmp_path)
    shard = damaged / "checkpoints" / "step00000004" / "mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:100]) if damage == "truncate" else shard.unlink()
    before = {p: p.read_bytes() for p in damaged.rglob("*") if p.is_file()}
    result = run(train_command("python", 1, "--max_steps", 6, "--output_dir", damaged, "--resume", "auto"))
    _fails(result, text)
    _untouched(before)


@pytest.mark.slow
def test_resume_path_that_is_not_a_checkpoint(saved_run, tmp_path):
    result = run(train_command("python", 1, "--output_dir", tmp_path / "x", "--resume", saved_run))
    _fails(result, "is not a complete checkpoint")


@pytest.mark.slow
@pytest.mark.parametrize("args, text", [
    (["--model", "mlp"], "was made with model='cnn' but this run has model='mlp'"),
    (["--deepspeed_config", REPO / "ds_configs" / "zero2.json"], "zero_stage=0 but this run has zero_stage=2"),
])
def test_checkpoint_of_another_setup_is_refused(args, text, saved_run, tmp_path):
    copy, before = _copy(saved_run, tmp_path)
    result = run(train_command("python", 1, *args, "--max_steps", 6, "--output_dir", copy, "--resume", "auto"))
    _fails(result, text)
    _untouched(before)


@pytest.mark.slow
def test_resume_auto_without_checkpoints_starts_fresh(saved_run):
    stdout = (saved_run.parent / "stdout.txt").read_text()
    assert "no complete checkpoint" in stdout and "starting fresh" in stdout
    manifest = json.loads((saved_run / "checkpoints" / "step00000004" / "manifest.json").read_text())
    assert {"mp_rank_00_model_states.pt", "trainer_state.json", "rng_rank00000.json"} <= set(manifest)
    assert (saved_run / "checkpoints" / "latest").read_text() == "step00000004"


@pytest.mark.slow
@pytest.mark.parametrize("name, before, after", [("zero2", 2, 1), ("zero3", 1, 2)])
def test_resume_at_another_world_size(name, before, after, tmp_path):
    """ZeRO state saved by N ranks continues on M ranks through a universal checkpoint."""
    config, out = REPO / "ds_configs" / f"{name}.json", tmp_path / "run"
    launcher = {1: "python", 2: "deepspeed"}
    train(launcher[before], before, "--deepspeed_config", config, "--max_steps", 10, "--log_interval", 1,
          "--output_dir", out)
    result = train(launcher[after], after, "--deepspeed_config", config, "--max_steps", 20, "--log_interval", 1,
                   "--output_dir", out, "--resume", "auto")
    assert f"saved by {before} rank(s), this run has {after}: converting it to a universal checkpoint" in result.stdout
    assert "at step 10" in result.stdout
    rows = read_metrics(out)[0]
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert rows[-1]["loss"] < rows[9]["loss"] < rows[0]["loss"], "training goes on from where it was"
    assert json.loads((out / "summary.json").read_text())["world_size"] == after


# -- without an engine: checkpoint folders written by hand ---------------------------------------------------

def _state(**changes) -> TrainerState:
    """What a 1-rank digits CNN run under ds_configs/dp.json records at step 4 (micro batch 4 of epoch 0)."""
    values = dict(step=4, epoch=0, batch=4, model="cnn", dataset="digits", world_size=1, zero_stage=0,
                  settings={"model": "cnn", "dataset": "digits", "seed": 42, "max_steps": 6},
                  data_info={"num_classes": 10, "in_channels": 1, "image_size": 8, "task": "image_classification",
                             "vocab_size": 0, "seq_len": 0},
                  deepspeed_config={"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1,
                                    "train_batch_size": 32, "zero_optimization": {"stage": 0}})
    return TrainerState(**{**values, **changes})


SHARDS = {"mp_rank_00_model_states.pt": b"weights " * 64, "rng_rank00000.json": b'{"torch": [1, 2, 3]}',
          "hf/config.json": b'{"model_type": "gpt2"}'}


def _write_checkpoint(folder, state=None, state_text=None, manifest=True):
    """A checkpoint folder as save() leaves it: the shards, trainer_state.json, then manifest.json listing every
    file (relative name -> size and sha256)."""
    folder.mkdir(parents=True)
    for name, data in SHARDS.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / STATE).write_text(state_text if state_text is not None else (state or _state()).to_json())
    if manifest:
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        listed = {str(p.relative_to(folder)): {"size": len(p.read_bytes()),
                                               "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in files}
        (folder / MANIFEST).write_text(json.dumps(listed, indent=1))
    return folder


def _one_line(caught) -> str:
    message = str(caught.value)
    assert message and "\n" not in message, message
    return message


def test_trainer_state_round_trips_through_json():
    state = _state(step=15, epoch=1, batch=7)
    saved = json.loads(state.to_json())
    assert saved["step"] == 15 and saved["settings"]["seed"] == 42
    assert saved["deepspeed_config"]["train_batch_size"] == 32
    assert TrainerState.from_json(state.to_json(), "x") == state


def test_a_state_file_lacking_fields_is_one_line_naming_them(tmp_path):
    old = {"step": 4, "epoch": 0, "batch": 4, "model": "cnn", "dataset": "digits", "world_size": 1, "zero_stage": 0}
    with pytest.raises(UserError) as caught:
        TrainerState.from_json(json.dumps(old), "run/checkpoints/step00000004/trainer_state.json")
    message = _one_line(caught)
    assert message.startswith("run/checkpoints/step00000004/trainer_state.json lacks settings, data_info, "
                              "deepspeed_config"), message
    assert "not written by this app" in message
    # the same through verify(): the manifest vouches for the file, but it is not a whole record
    folder = _write_checkpoint(tmp_path / "step00000004", state_text=json.dumps(old))
    with pytest.raises(UserError, match="trainer_state.json lacks settings, data_info, deepspeed_config") as caught:
        checkpoint.verify(folder)
    assert str(folder / STATE) in _one_line(caught)


def test_at_moves_the_position_and_keeps_the_record():
    state = _state()
    later = state.at(10, 1, 3)
    assert (later.step, later.epoch, later.batch) == (10, 1, 3)
    assert (state.step, state.epoch, state.batch) == (4, 0, 4), "the run's own record is left as it was"
    assert (later.model, later.settings, later.deepspeed_config) == \
        (state.model, state.settings, state.deepspeed_config)


@pytest.mark.parametrize("batch, micro, world, samples", [(0, 32, 1, 0), (4, 32, 1, 128), (3, 4, 2, 24),
                                                          (5, 8, 3, 120)])
def test_samples_into_epoch_counts_every_rank(batch, micro, world, samples):
    state = _state(batch=batch, world_size=world, deepspeed_config={"train_micro_batch_size_per_gpu": micro})
    assert state.samples_into_epoch() == samples


def test_verify_returns_the_saved_state_of_a_whole_checkpoint(tmp_path):
    state = _state(step=20, epoch=1, batch=3, world_size=2, zero_stage=2)
    saved = checkpoint.verify(_write_checkpoint(tmp_path / "step00000020", state))
    assert isinstance(saved, TrainerState) and saved == state
    assert (saved.step, saved.world_size, saved.zero_stage) == (20, 2, 2)


def test_verify_refuses_a_folder_without_a_manifest(tmp_path):
    folder = _write_checkpoint(tmp_path / "step00000004", manifest=False)
    with pytest.raises(UserError, match=f"{folder} is not a complete checkpoint \\(no manifest.json\\)") as caught:
        checkpoint.verify(folder)
    _one_line(caught)


@pytest.mark.parametrize("name, damage, problem", [
    ("mp_rank_00_model_states.pt", "delete", "is missing"),
    ("mp_rank_00_model_states.pt", "truncate", "does not match its manifest"),
    ("mp_rank_00_model_states.pt", "append", "does not match its manifest"),
    ("rng_rank00000.json", "same size, other bytes", "does not match its manifest"),
    ("hf/config.json", "same size, other bytes", "does not match its manifest"),
    ("trainer_state.json", "same size, other bytes", "does not match its manifest"),
])
def test_verify_names_a_missing_or_changed_file(name, damage, problem, tmp_path):
    folder = _write_checkpoint(tmp_path / "step00000004")
    path = folder / name
    data = path.read_bytes()
    if damage == "delete":
        path.unlink()
    elif damage == "truncate":
        path.write_bytes(data[:10])
    elif damage == "append":
        path.write_bytes(data + b"\0")
    else:  # the size still matches: only the sha256 tells
        path.write_bytes(data[:5] + bytes([data[5] ^ 1]) + data[6:])
    with pytest.raises(UserError) as caught:
        checkpoint.verify(folder)
    assert _one_line(caught) == f"checkpoint {folder} is damaged: {name} {problem}; resume from an older checkpoint"


def test_find_without_resume_or_checkpoints_starts_fresh(tmp_path):
    assert checkpoint.find(tmp_path / "new-run", "auto") == (None, None), "no checkpoints folder at all"
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert checkpoint.find(tmp_path / "run", "auto") == (None, None), "an empty checkpoints folder"
    _write_checkpoint(tmp_path / "run" / "checkpoints" / "step00000004", manifest=False)
    assert checkpoint.find(tmp_path / "run", "auto") == (None, None), "only a save killed before its manifest"
    _write_checkpoint(tmp_path / "run" / "checkpoints" / "step00000002")
    assert checkpoint.find(tmp_path / "run", "") == (None, None), "no --resume: checkpoints are not looked at"


def test_find_auto_picks_the_newest_complete_checkpoint(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for step in (5, 10, 9):
        _write_checkpoint(root / f"step{step:08d}", _state(step=step))
    _write_checkpoint(root / "step00000015", _state(step=15), manifest=False)  # killed half-way
    folder, saved = checkpoint.find(tmp_path / "run", "auto")
    assert folder == root / "step00000010" and saved.step == 10
    assert checkpoint.complete_checkpoints(root) == [root / f"step{s:08d}" for s in (5, 9, 10)]


def test_find_auto_does_not_fall_back_past_a_damaged_newest_checkpoint(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    _write_checkpoint(root / "step00000005", _state(step=5))
    _write_checkpoint(root / "step00000010", _state(step=10))
    (root / "step00000010" / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(UserError, match="step00000010 is damaged: mp_rank_00_model_states.pt is missing"):
        checkpoint.find(tmp_path / "run", "auto")


def test_find_a_named_folder(tmp_path):
    folder = _write_checkpoint(tmp_path / "run" / "checkpoints" / "step00000004")
    assert checkpoint.find(tmp_path / "elsewhere", str(folder)) == (folder, _state())
    with pytest.raises(UserError, match=f"--resume {tmp_path / 'nope'}: no such checkpoint folder") as caught:
        checkpoint.find(tmp_path / "run", str(tmp_path / "nope"))
    _one_line(caught)
    with pytest.raises(UserError, match="is not a complete checkpoint"):
        checkpoint.find(tmp_path / "run", str(tmp_path / "run"))


@pytest.mark.parametrize("change, text", [
    ({"model": "mlp"}, "was made with model='cnn' but this run has model='mlp'"),
    ({"dataset": "synthetic"}, "was made with dataset='digits' but this run has dataset='synthetic'"),
    ({"zero_stage": 2}, "was made with zero_stage=0 but this run has zero_stage=2"),
    ({"pipeline_stages": 2}, "was made with pipeline_stages=0 but this run has pipeline_stages=2"),
    ({"tensor_parallel_size": 2}, "was made with tensor_parallel_size=1 but this run has tensor_parallel_size=2"),
])
def test_a_checkpoint_of_another_model_dataset_or_stage_is_refused(change, text, tmp_path):
    with pytest.raises(UserError, match=text) as caught:
        checkpoint.check_compatible(_state(), _state(**change), tmp_path / "step00000004")
    assert _one_line(caught).startswith(f"checkpoint {tmp_path / 'step00000004'} was made with")


def test_what_may_change_across_a_resume():
    """Position, world size, flags and the DeepSpeed dict may differ: those are what a resumed run changes."""
    current = _state(step=0, epoch=0, batch=0, world_size=4, settings={"max_steps": 100},
                     deepspeed_config={"train_micro_batch_size_per_gpu": 8})
    checkpoint.check_compatible(_state(), current, "step00000004")


@pytest.mark.parametrize("stage, saved_world, world, needed", [
    (0, 2, 1, False),  # stage 0: every rank holds everything, any world size loads it
    (1, 2, 2, False), (1, 2, 1, True), (2, 1, 2, True), (3, 2, 3, True), (3, 4, 4, False),
])
def test_needs_universal_only_for_partitioned_state_on_another_world_size(stage, saved_world, world, needed):
    assert checkpoint.needs_universal(_state(zero_stage=stage, world_size=saved_world), world) is needed


def test_plan_resume_without_a_checkpoint(tmp_path, capsys):
    ds = {"train_micro_batch_size_per_gpu": 32}
    assert checkpoint.plan_resume(tmp_path, "", _state(), ds) == (None, None, ds)
    assert capsys.readouterr().out == ""
    assert checkpoint.plan_resume(tmp_path, "auto", _state(), ds) == (None, None, ds)
    assert capsys.readouterr().out == f"resume: no complete checkpoint in {tmp_path / 'checkpoints'}, starting fresh\n"


@pytest.mark.parametrize("split", [dict(pipeline_stages=2), dict(tensor_parallel_size=2)])
def test_a_model_parallel_run_resumes_only_on_its_own_world_size(split, tmp_path):
    _write_checkpoint(tmp_path / "checkpoints" / "step00000004", _state(world_size=2, **split))
    with pytest.raises(UserError, match="run of 2 rank.s. and the app cannot reshape.*resume it with 2 rank") as caught:
        checkpoint.plan_resume(tmp_path, "auto", _state(step=0, world_size=4, **split), {})
    _one_line(caught)


def test_samples_into_epoch_counts_replicas_not_stages():
    """2 stages x 2 replicas at micro batch 32: 4 micro batches into the epoch are 4 x 32 x 2 samples."""
    assert _state(batch=4, world_size=4, pipeline_stages=2, data_parallel_size=2).samples_into_epoch() == 256


def test_plan_resume_checks_before_anything_is_built(tmp_path):
    folder = _write_checkpoint(tmp_path / "checkpoints" / "step00000004", _state(world_size=2))
    ds = {"train_micro_batch_size_per_gpu": 32}
    # ZeRO stage 0 saved by 2 ranks loads on 1 as it is: no conversion, the dict unchanged
    assert checkpoint.plan_resume(tmp_path, "auto", _state(step=0, world_size=1), ds) == \
        (folder, _state(world_size=2), ds)
    with pytest.raises(UserError, match="was made with model='cnn' but this run has model='mlp'"):
        checkpoint.plan_resume(tmp_path, "auto", _state(model="mlp"), ds)


def test_a_state_saved_before_model_parallelism_loads_with_its_defaults(tmp_path):
    """Checkpoints written before the pipeline and tensor-parallel fields existed still resume."""
    saved = json.loads(_state().to_json())
    for key in ("pipeline_stages", "data_parallel_size", "tensor_parallel_size"):
        del saved[key]
    state = TrainerState.from_json(json.dumps(saved), tmp_path / STATE)
    assert (state.pipeline_stages, state.data_parallel_size, state.tensor_parallel_size) == (0, 0, 1)
    assert state.samples_into_epoch() == 4 * 32 * 1, "the world size stands in for the replicas"
