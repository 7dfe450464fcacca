"""Resume in one process: the trainer state's record, hand-written checkpoint folders verified against their
manifests, the checkpoint to continue from, and what may change across a resume."""
import hashlib
import io
import json
from pathlib import Path

import pytest
import torch

from app.checkpoint import save
from app.checkpoint import resume
from app.checkpoint.save import MANIFEST, STATE, TrainerState
from app.errors import UserError


def _state(**changes) -> TrainerState:
    """What a 1-rank digits CNN run under ds_configs/dp.json records at step 4 (micro batch 4 of epoch 0)."""
    values = dict(step=4, epoch=0, batch=4, model="cnn", dataset="digits", world_size=1, zero_stage=0,
                  settings={"model": "cnn", "dataset": "digits", "seed": 42, "max_steps": 6},
                  data_info={"num_classes": 10, "in_channels": 1, "image_size": 8, "task": "image_classification",
                             "vocab_size": 0, "seq_len": 0},
                  deepspeed_config={"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1,
                                    "train_batch_size": 32, "zero_optimization": {"stage": 0}})
    return TrainerState(**{**values, **changes})


def _torch_bytes(value) -> bytes:
    saved = io.BytesIO()
    torch.save(value, saved)
    return saved.getvalue()


SHARDS = {"mp_rank_00_model_states.pt": _torch_bytes({"module": {"w": torch.ones(4)}, "global_steps": 4}), "rng_rank00000.json": b'{"torch": [1, 2, 3]}',
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
        resume.verify(folder)
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
    saved = resume.verify(_write_checkpoint(tmp_path / "step00000020", state))
    assert isinstance(saved, TrainerState) and saved == state
    assert (saved.step, saved.world_size, saved.zero_stage) == (20, 2, 2)


def test_verify_refuses_a_folder_without_a_manifest(tmp_path):
    folder = _write_checkpoint(tmp_path / "step00000004", manifest=False)
    with pytest.raises(UserError, match=f"{folder} is not a complete checkpoint \\(no manifest.json\\)") as caught:
        resume.verify(folder)
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
        resume.verify(folder)
    assert _one_line(caught) == f"checkpoint {folder} is damaged: {name} {problem}; start a new --output_dir"


@pytest.mark.parametrize("name", [MANIFEST, STATE])
@pytest.mark.parametrize("damage", ["cut short", "not text", "not an object", "a folder"])
def test_a_checkpoint_json_file_cut_short_or_of_another_kind_is_one_line(name, damage, tmp_path):
    """The files the manifest cannot vouch for: itself, and (if the manifest is rewritten to match) the state."""
    root = tmp_path / "run" / "checkpoints"
    older = _write_checkpoint(root / "step00000002", _state(step=2))
    folder = _write_checkpoint(root / "step00000004")
    path = folder / name
    if damage == "cut short":
        path.write_text(path.read_text()[:40])
    elif damage == "not text":
        path.write_bytes(b"\x89PNG\x00\xff" * 8)
    elif damage == "not an object":
        path.write_text("[1, 2, 3]" if name == STATE else "null")
    else:
        path.unlink()
        path.mkdir()
    if name == STATE:  # a manifest that vouches for the damaged state file
        listed = json.loads((folder / MANIFEST).read_text())
        listed.pop(STATE)
        (folder / MANIFEST).write_text(json.dumps(listed))
    with pytest.raises(UserError) as caught:
        resume.verify(folder)
    line = _one_line(caught)
    if not (name == MANIFEST and damage == "a folder"):  # no manifest file: not a complete checkpoint at all
        assert line.startswith(f"checkpoint {folder} is damaged: {name} "), line
    assert f"--resume {older}" in line or "is not a complete checkpoint" in line, line


def test_find_without_resume_or_checkpoints_starts_fresh(tmp_path):
    assert resume.find(tmp_path / "new-run", "auto") == (None, None), "no checkpoints folder at all"
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert resume.find(tmp_path / "run", "auto") == (None, None), "an empty checkpoints folder"
    _write_checkpoint(tmp_path / "run" / "checkpoints" / "step00000004", manifest=False)
    assert resume.find(tmp_path / "run", "auto") == (None, None), "only a save killed before its manifest"
    _write_checkpoint(tmp_path / "run" / "checkpoints" / "step00000002")
    assert resume.find(tmp_path / "run", "") == (None, None), "no --resume: checkpoints are not looked at"


def test_find_auto_picks_the_newest_complete_checkpoint(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for step in (5, 10, 9):
        _write_checkpoint(root / f"step{step:08d}", _state(step=step))
    _write_checkpoint(root / "step00000015", _state(step=15), manifest=False)  # killed half-way
    folder, saved = resume.find(tmp_path / "run", "auto")
    assert folder == root / "step00000010" and saved.step == 10
    assert save.complete_checkpoints(root) == [root / f"step{s:08d}" for s in (5, 9, 10)]


def test_find_auto_does_not_fall_back_past_a_damaged_newest_checkpoint(tmp_path):
    """The line names the one before, as a command that is accepted: the damaged newest is a later checkpoint of
    the same timeline, which only --overwrite lets go (the path quoted: the run's folder has a space)."""
    import shlex
    from app.checkpoint import outdir
    run = tmp_path / "my run"
    root = run / "checkpoints"
    _write_checkpoint(root / "step00000005", _state(step=5))
    _write_checkpoint(root / "step00000010", _state(step=10))
    (root / "step00000010" / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(UserError, match="step00000010 is damaged: mp_rank_00_model_states.pt is missing") as caught:
        resume.find(run, "auto")
    words = shlex.split(_one_line(caught).split("deleting the later ones: ")[1])
    assert words == ["--resume", str(root / "step00000005"), "--overwrite"]
    assert outdir.check_timeline(run, Path(words[1]), overwrite=True) == ""
    assert "--overwrite deletes them" in outdir.check_timeline(run, Path(words[1]), overwrite=False)


def test_find_a_named_folder(tmp_path):
    folder = _write_checkpoint(tmp_path / "run" / "checkpoints" / "step00000004")
    assert resume.find(tmp_path / "elsewhere", str(folder)) == (folder, _state())
    with pytest.raises(UserError, match=f"--resume {tmp_path / 'nope'}: no such folder") as caught:
        resume.find(tmp_path / "run", str(tmp_path / "nope"))
    _one_line(caught)
    (tmp_path / "plain").mkdir()
    with pytest.raises(UserError, match="is not a complete checkpoint"):
        resume.find(tmp_path / "run", str(tmp_path / "plain"))


def test_a_run_folder_names_its_newest_complete_checkpoint(tmp_path, capsys):
    root = tmp_path / "run" / "checkpoints"
    for step in (2, 4):
        _write_checkpoint(root / f"step{step:08d}", _state(step=step))
    _write_checkpoint(root / "step00000006", _state(step=6), manifest=False)  # a save cut short
    for named in (tmp_path / "run", root):
        assert resume.checkpoint_folder(named) == root / "step00000004"
        assert resume.find(tmp_path / "other", str(named))[1].step == 4
        assert f"resume: the newest complete checkpoint of {named} is step00000004" in capsys.readouterr().out
    assert resume.checkpoint_folder(root / "step00000002") == root / "step00000002", "a checkpoint is itself"
    (root / "step00000002" / MANIFEST).unlink()
    (root / "step00000004" / MANIFEST).unlink()
    with pytest.raises(UserError, match="holds no complete checkpoint"):
        resume.checkpoint_folder(tmp_path / "run")


@pytest.mark.parametrize("change, text", [
    ({"model": "mlp"}, "was made with model='cnn' but this run has model='mlp'"),
    ({"dataset": "synthetic"}, "was made with dataset='digits' but this run has dataset='synthetic'"),
    ({"zero_stage": 2}, "was made with zero_stage=0 but this run has zero_stage=2"),
    ({"pipeline_stages": 2}, "was made with pipeline_stages=0 but this run has pipeline_stages=2"),
    ({"tensor_parallel_size": 2}, "was made with tensor_parallel_size=1 but this run has tensor_parallel_size=2"),
])
def test_a_checkpoint_of_another_model_dataset_or_stage_is_refused(change, text, tmp_path):
    with pytest.raises(UserError, match=text) as caught:
        resume.check_compatible(_state(), _state(**change), tmp_path / "step00000004")
    assert _one_line(caught).startswith(f"checkpoint {tmp_path / 'step00000004'} was made with")


@pytest.mark.parametrize("key, then, now, within", [
    ("mix_weights", "1,3", "1,1", {}), ("mix_by", "rows", "tokens", {"mix_weights": "1,3"}),
    ("streaming", "off", "on", {}), ("shuffle_buffer", 10000, 100, {"streaming": "on"}),
    ("seed", 1, 42, {})])  # the seed shuffles each epoch and holds rows out where no validation split does
def test_a_resume_that_would_train_on_other_rows_is_refused(key, then, now, within, tmp_path):
    saved, current = (_state(settings={"model": "cnn", **within, key: value}) for value in (then, now))
    with pytest.raises(UserError, match=f"was made with --{key} {then!r} but this run has {now!r}, which trains on "
                                        f"other rows"):
        resume.check_compatible(saved, current, tmp_path / "step00000004")
    resume.check_compatible(_state(settings={}), _state(settings={key: {"mix_by": "rows", "streaming": "off",
                                                                          "shuffle_buffer": 10000,
                                                                          "seed": 42}.get(key, "")}),
                            tmp_path)  # a checkpoint from before these flags: their defaults


def test_a_change_of_flags_that_draws_the_same_rows_resumes():
    """Weights of the same shares however written, what they weigh by where there are none, a buffer where nothing
    streams: the resumed run reads the rows it would have."""
    for then, now in [({"mix_weights": "2,1"}, {"mix_weights": "4, 2"}), ({"mix_by": "rows"}, {"mix_by": "tokens"}),
                      ({"shuffle_buffer": 10000}, {"shuffle_buffer": 0})]:
        resume.check_compatible(_state(settings=then), _state(settings=now), "step00000004")


def test_what_may_change_across_a_resume():
    """Position, world size, flags and the DeepSpeed dict may differ: those are what a resumed run changes."""
    current = _state(step=0, epoch=0, batch=0, world_size=4, settings={"max_steps": 100},
                     deepspeed_config={"train_micro_batch_size_per_gpu": 8})
    resume.check_compatible(_state(), current, "step00000004")


DPO = {"loss": "sigmoid", "beta": 0.1, "gamma": 0.5, "reference": "frozen copy", "base": "gpt2-tiny seed 42"}
SIMPO = {**DPO, "loss": "simpo", "beta": 2.0, "reference": "none (SimPO)"}


@pytest.mark.parametrize("then, now, differs, flags", [
    (DPO, {**DPO, "loss": "ipo"}, "loss 'sigmoid' -> 'ipo'", "--preference_loss"),
    (DPO, {**DPO, "beta": 0.2}, "beta 0.1 -> 0.2", "--beta"),
    (DPO, {**DPO, "reference": "precomputed"}, "reference 'frozen copy' -> 'precomputed'", "--reference"),
    (SIMPO, {**SIMPO, "gamma": 1.0}, "gamma 0.5 -> 1.0", "--simpo_gamma"),
    (DPO, SIMPO, "loss 'sigmoid' -> 'simpo', beta 0.1 -> 2.0, reference 'frozen copy' -> 'none (SimPO)'",
     "--preference_loss, --beta, --reference"),
])
def test_a_preference_run_resumed_with_other_settings_is_one_line_naming_them(then, now, differs, flags, tmp_path):
    _write_checkpoint(tmp_path / "checkpoints" / "step00000004", _state(task_record=then))
    with pytest.raises(UserError) as caught:
        resume.checkpoint_to_resume(tmp_path, "auto", _state(step=0, task_record=now))
    assert _one_line(caught) == (f"checkpoint {tmp_path / 'checkpoints' / 'step00000004'} was made with other "
                                 f"preference settings than this run has ({differs}), which would change the loss "
                                 f"mid-run; pass the same {flags} as that run or start a new --output_dir")


def test_a_preference_run_resumes_with_its_own_settings_and_gamma_counts_only_for_simpo(tmp_path):
    folder = _write_checkpoint(tmp_path / "checkpoints" / "step00000004", _state(task_record=DPO))
    assert resume.checkpoint_to_resume(tmp_path, "auto", _state(step=0, task_record=DPO))[0] == folder
    resume.check_compatible(_state(task_record=DPO), _state(task_record={**DPO, "gamma": 1.0}), folder)


@pytest.mark.parametrize("then, now, message", [
    (DPO, {**DPO, "base": "gpt2-tiny seed 7"}, "trained against a reference of another base model than gpt2-tiny"),
    ({}, DPO, "was made with no preference tuning but this run has preference tuning; pass the same --task"),
    (DPO, {}, "was made with preference tuning but this run has no preference tuning; pass the same --task"),
])
def test_a_preference_run_resumed_on_another_base_or_task_is_refused(then, now, message, tmp_path):
    with pytest.raises(UserError, match=message) as caught:
        resume.check_compatible(_state(model="gpt2-tiny", task_record=then), _state(model="gpt2-tiny", task_record=now),
                                tmp_path)
    assert _one_line(caught).endswith("start a new --output_dir")
    # SimPO trains against no reference: its base may change as another task's may
    resume.check_compatible(_state(task_record=SIMPO), _state(task_record={**SIMPO, "base": "other"}), tmp_path)
    hub = {**DPO, "base": "org/tiny (hub, revision None)"}  # saved when a hub model's revision could not be read
    resume.check_compatible(_state(task_record=hub), _state(task_record={**hub, "base": "org/tiny (hub, revision "
                                                                                         "0123abcd)"}), tmp_path)


def _windows(micro: int, accumulation: int, replicas: int, repeats: int = 2) -> TrainerState:
    """A GRPO run's state with --num_iterations repeats (1: recorded as before it had the key)."""
    record = {"task": "grpo", **({"num_iterations": repeats} if repeats > 1 else {})}
    return _state(world_size=replicas, data_parallel_size=replicas, task_record=record,
                  deepspeed_config={"train_micro_batch_size_per_gpu": micro,
                                    "gradient_accumulation_steps": accumulation})


def test_a_run_that_repeats_its_windows_resumes_only_on_the_same_windows(tmp_path):
    """--num_iterations 2: micro 4 on 2 ranks resumes as micro 8 on 1 (the same global micro batches), not as micro
    4 on 1 nor with another accumulation; once a window (1) any layout resumes."""
    resume.check_compatible(_windows(4, 2, 2), _windows(8, 2, 1), tmp_path)
    resume.check_compatible(_windows(4, 2, 2, repeats=1), _windows(4, 1, 1, repeats=1), tmp_path)
    for now in (_windows(4, 2, 1), _windows(8, 1, 2)):
        with pytest.raises(UserError, match="trains each window of prompts 2 times .* over windows of 2 global "
                                            "micro batch.es. of 8; this run has") as caught:
            resume.check_compatible(_windows(4, 2, 2), now, tmp_path)
        assert _one_line(caught).endswith("resume with train_micro_batch_size_per_gpu x data-parallel ranks = 8 "
                                          "and gradient_accumulation_steps = 2")
    with pytest.raises(UserError, match=r"num_iterations None -> 2"):
        resume.check_compatible(_windows(4, 2, 2, repeats=1), _windows(4, 2, 2), tmp_path)


@pytest.mark.parametrize("stage, saved_world, world, needed", [
    (0, 2, 1, False),  # stage 0: every rank holds everything, any world size loads it
    (1, 2, 2, False), (1, 2, 1, True), (2, 1, 2, True), (3, 2, 3, True), (3, 4, 4, False),
])
def test_needs_universal_only_for_partitioned_state_on_another_world_size(stage, saved_world, world, needed):
    assert resume.needs_universal(_state(zero_stage=stage, world_size=saved_world), world) is needed


def test_checkpoint_to_resume_without_a_checkpoint(tmp_path, capsys):
    assert resume.checkpoint_to_resume(tmp_path, "", _state()) == (None, None, False)
    assert capsys.readouterr().out == ""
    assert resume.checkpoint_to_resume(tmp_path, "auto", _state()) == (None, None, False)
    assert capsys.readouterr().out == f"resume: no complete checkpoint in {tmp_path / 'checkpoints'}, starting fresh\n"


@pytest.mark.parametrize("split", [dict(pipeline_stages=2), dict(tensor_parallel_size=2)])
def test_a_model_parallel_run_resumes_only_on_its_own_world_size(split, tmp_path):
    _write_checkpoint(tmp_path / "checkpoints" / "step00000004", _state(world_size=2, **split))
    with pytest.raises(UserError, match="run of 2 rank.s. and the app cannot reshape.*resume it with 2 rank") as caught:
        resume.checkpoint_to_resume(tmp_path, "auto", _state(step=0, world_size=4, **split))
    _one_line(caught)


def _offloaded(stage: int, world: int, device) -> TrainerState:
    """A run of `world` ranks at this ZeRO stage whose optimizer state DeepSpeed keeps on `device` (None: no
    offload_optimizer section)."""
    zero = {"stage": stage, **({"offload_optimizer": {"device": device}} if device else {})}
    return _state(zero_stage=stage, world_size=world, deepspeed_config={**_state().deepspeed_config,
                                                                        "zero_optimization": zero})


@pytest.mark.parametrize("saved, current, refused", [
    ((3, 2, "nvme"), (3, 2, "nvme"), False),  # as it was saved: DeepSpeed copies the swap files back
    ((3, 2, "nvme"), (3, 1, "nvme"), True),  # ds_to_universal reads no swap file
    ((3, 2, "cpu"), (3, 2, "nvme"), True),  # DeepSpeed would look for swap files never written
    ((3, 2, "nvme"), (3, 2, None), True),  # and load the empty saved moments as they are
    ((3, 2, "nvme"), (3, 2, "none"), True),
    ((3, 2, "cpu"), (3, 1, None), False),  # no NVMe: the universal checkpoint as any run's
    ((2, 2, "nvme"), (2, 1, "nvme"), False),  # ZeRO-2 takes NVMe for the CPU: nothing swapped
])
def test_an_optimizer_state_on_nvme_resumes_only_with_its_ranks_and_device(saved, current, refused, tmp_path):
    saved, current = _offloaded(*saved), _offloaded(*current)
    if not refused:
        resume._check_nvme(saved, current, tmp_path)
        return
    with pytest.raises(UserError, match="DeepSpeed loads a state offloaded to NVMe only as it was saved") as caught:
        resume._check_nvme(saved, current, tmp_path)
    _one_line(caught)


def test_samples_into_epoch_counts_replicas_not_stages():
    """2 stages x 2 replicas at micro batch 32: 4 micro batches into the epoch are 4 x 32 x 2 samples."""
    assert _state(batch=4, world_size=4, pipeline_stages=2, data_parallel_size=2).samples_into_epoch() == 256


def test_checkpoint_to_resume_checks_before_anything_is_built(tmp_path):
    folder = _write_checkpoint(tmp_path / "checkpoints" / "step00000004", _state(world_size=2))
    # ZeRO stage 0 saved by 2 ranks loads on 1 as it is: no conversion
    assert resume.checkpoint_to_resume(tmp_path, "auto", _state(step=0, world_size=1)) == (folder, _state(world_size=2), False)
    with pytest.raises(UserError, match="was made with model='cnn' but this run has model='mlp'"):
        resume.checkpoint_to_resume(tmp_path, "auto", _state(model="mlp"))


def test_a_state_saved_before_model_parallelism_loads_with_its_defaults(tmp_path):
    """Checkpoints written before the pipeline and tensor-parallel fields existed still resume."""
    saved = json.loads(_state().to_json())
    for key in ("pipeline_stages", "data_parallel_size", "tensor_parallel_size"):
        del saved[key]
    state = TrainerState.from_json(json.dumps(saved), tmp_path / STATE)
    assert (state.pipeline_stages, state.data_parallel_size, state.tensor_parallel_size) == (0, 0, 1)
    assert state.samples_into_epoch() == 4 * 32 * 1, "the world size stands in for the replicas"


def test_resume_on_fewer_gpus_restores_the_rank_s_own_generator(monkeypatch):
    """Saved on GPU 3 of 8, resumed where a rank sees one GPU (srun --gpus-per-task=1, a smaller node): the
    state of its own GPU, not every GPU's (set_rng_state_all raised IndexError there)."""
    states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(8)}
    current, restored = {"index": 3}, []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[current["index"]])
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [states[i] for i in range(8)])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state.tolist()))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states_: restored.append("every GPU"))
    saved = json.loads(json.dumps(save._rng_state()))
    assert saved["cuda"] == [[3] * 16], "only the rank's own GPU is saved"
    current["index"] = 0
    save.set_rng_state(saved)
    assert restored == [[3] * 16]
    restored.clear()
    current["index"] = 5  # a checkpoint from before held every visible GPU's state, by index
    save.set_rng_state({**saved, "cuda": [states[i].tolist() for i in range(8)]})
    assert restored == [[5] * 16]
