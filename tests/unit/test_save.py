"""Saving without an engine: the trainer state read back, atomic writes, RNG states, rank 0's checks before a save."""
import hashlib
import json
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from app.checkpoint import save
from app.checkpoint.save import LATEST, MANIFEST, SAVING, UNIVERSAL, TrainerState
from app.errors import UserError


def _state(**changes) -> TrainerState:
    """What a 1-rank digits CNN run under ds_configs/dp.json records at step 4."""
    values = dict(step=4, epoch=0, batch=4, model="cnn", dataset="digits", world_size=1, zero_stage=0,
                  settings={"model": "cnn", "seed": 42}, data_info={"num_classes": 10},
                  deepspeed_config={"train_micro_batch_size_per_gpu": 32, "zero_optimization": {"stage": 0}})
    return TrainerState(**{**values, **changes})

def _checkpoint(root, step, complete=True, size=10):
    folder = root / f"step{step:08d}"
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"x" * size)
    (folder / (MANIFEST if complete else SAVING)).write_text("{}")
    return folder


def test_an_older_state_file_gets_the_fields_added_since_and_a_newer_ones_extra_fields_are_left():
    saved = json.loads(_state().to_json())
    for added in ("pipeline_stages", "data_parallel_size", "tensor_parallel_size", "lora"):
        del saved[added]
    old = TrainerState.from_json(json.dumps(saved), "x")
    assert (old.pipeline_stages, old.data_parallel_size, old.tensor_parallel_size, old.lora) == (0, 0, 1, {})
    newer = TrainerState.from_json(json.dumps({**saved, "sequence_parallel_size": 2}), "x")
    assert newer == old
    record = {"loss": "sigmoid", "beta": 0.1}
    del saved["task_record"]
    assert TrainerState.from_json(json.dumps({**saved, "preference": record}), "x").task_record == record, \
        "a preference run's record, as checkpoints before task records wrote it, is read as the task's"


@pytest.mark.parametrize("text", ["[4, 0, 4]", '"step 4"', "null", "4"])
def test_a_state_file_that_is_not_a_record_is_one_line(text):
    with pytest.raises(UserError, match="^run/step00000004/trainer_state.json holds no trainer state: it was not "
                                        "written by this app; start a new run$"):
        TrainerState.from_json(text, "run/step00000004/trainer_state.json")


def test_samples_into_epoch_count_the_data_replicas_not_the_ranks_under_tensor_parallelism():
    state = _state(batch=3, world_size=4, data_parallel_size=2, tensor_parallel_size=2,
                   deepspeed_config={"train_micro_batch_size_per_gpu": 8})
    assert state.samples_into_epoch() == 3 * 8 * 2


def test_an_atomic_write_replaces_the_whole_file_and_leaves_no_part(tmp_path):
    path = tmp_path / LATEST
    path.write_text("step00000002-and-a-longer-old-text")
    save.atomic_write(path, "step00000004")
    assert path.read_text() == "step00000004"
    assert [p.name for p in tmp_path.iterdir()] == [LATEST], "no temporary file left"


def test_an_atomic_write_replaces_a_planted_link_and_never_writes_through_it(tmp_path):
    victim = tmp_path / "elsewhere.txt"
    victim.write_text("the user's")
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / LATEST).symlink_to(victim)
    save.atomic_write(root / LATEST, "step00000004")
    assert victim.read_text() == "the user's"
    assert not (root / LATEST).is_symlink() and (root / LATEST).read_text() == "step00000004"


def test_the_digest_covers_a_file_longer_than_one_block(tmp_path):
    data = os.urandom(2**20 * 2 + 17)
    (tmp_path / "big").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    assert save.sha256_of(tmp_path / "big") == hashlib.sha256(data).hexdigest()
    assert save.sha256_of(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_the_rng_states_survive_json_and_a_resume_draws_the_same_numbers():
    written = json.dumps(save._rng_state())
    drawn = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    save.set_rng_state(json.loads(written))
    assert (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()) == drawn


def test_a_link_or_a_file_where_the_save_goes_is_refused(tmp_path):
    root = tmp_path / "checkpoints"
    elsewhere = _checkpoint(tmp_path / "other", 4)
    root.mkdir()
    (root / "step00000004").symlink_to(elsewhere)
    (root / "step00000006").write_text("")
    for step in (4, 6):
        folder = root / f"step{step:08d}"
        assert save._before_save(root, folder, 0) == f"{folder} is not a folder this run wrote (a link or a file); " \
                                                     f"move it away and resume"
    assert (elsewhere / MANIFEST).is_file(), "the link's target is untouched"


def test_a_checkpoint_already_whole_at_this_step_is_not_saved_again(tmp_path):
    root = tmp_path / "checkpoints"
    folder = _checkpoint(root, 4)
    assert save._before_save(root, folder, 10**18) == "saved"


def test_before_a_save_only_the_apps_unfinished_saves_are_cleared(tmp_path):
    root = tmp_path / "checkpoints"
    done, cut = _checkpoint(root, 2), _checkpoint(root, 4, complete=False)
    users = root / "step00000005"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    assert save._before_save(root, root / "step00000006", 10) == ""
    assert not cut.exists() and done.is_dir() and (users / "notes.txt").read_text() == "mine"


def test_the_room_a_save_needs_is_the_last_checkpoints_size_else_the_estimate(tmp_path):
    root = tmp_path / "checkpoints"
    too_big = save.disk.free_bytes(tmp_path) + 2**40
    line = save._before_save(root, root / "step00000002", too_big)
    assert line.startswith(f"not enough space to save a checkpoint in {root}: it needs about ") and \
        line.endswith("no checkpoint of this run was saved yet: run the same command again"), line
    _checkpoint(root, 2)
    assert save._before_save(root, root / "step00000004", too_big) == "", "the same tensors as last time"


def test_a_save_is_marked_as_the_apps_until_its_manifest(tmp_path):
    root = tmp_path / "checkpoints"
    folder = root / "step00000008"
    save._start(folder)
    assert json.loads((folder / SAVING).read_text()) == {"pid": os.getpid()}
    assert save.unfinished_saves(root) == [folder] and save.complete_checkpoints(root) == []
    (folder / MANIFEST).write_text("{}")
    assert save.unfinished_saves(root) == [] and save.complete_checkpoints(root) == [folder]


def test_a_save_the_folder_refused_names_the_last_whole_checkpoint_and_its_size(tmp_path):
    root = tmp_path / "checkpoints"
    _checkpoint(root, 2, size=3 * 2**20 - 2)
    line = save._cannot_write(root, OSError(28, "No space left on device"), 10**12)
    assert line.startswith(f"cannot save a checkpoint in {root}: the disk (or the quota) is full (it needs about "
                           f"3.0 MB, "), line
    assert line.endswith("the last complete checkpoint, step00000002, is whole: continue from it with --resume auto")


def test_checkpoints_come_oldest_first_and_only_the_apps_names_count(tmp_path):
    root = tmp_path / "checkpoints"
    made = [_checkpoint(root, step) for step in (10, 9, 100)]
    for name in ("step2", "step00000003-copy", "step_00000004"):
        (root / name).mkdir()
        (root / name / MANIFEST).write_text("{}")
    assert save.complete_checkpoints(root) == [made[1], made[0], made[2]]


def test_removing_a_checkpoint_removes_its_universal_copy_and_no_other(tmp_path):
    root = tmp_path / "checkpoints"
    old, kept = _checkpoint(root, 2), _checkpoint(root, 4)
    for folder in (old, kept):
        (root / UNIVERSAL / folder.name).mkdir(parents=True)
    save.remove_checkpoint(old)
    assert not old.exists() and not (root / UNIVERSAL / old.name).exists()
    assert kept.is_dir() and (root / UNIVERSAL / kept.name).is_dir()
    save.remove_checkpoint(kept)
    assert save.complete_checkpoints(root) == []


def test_frozen_weights_are_left_out_only_when_there_are_some():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    assert not save.has_frozen(SimpleNamespace(module=module))
    module[0].weight.requires_grad_(False)
    assert save.has_frozen(SimpleNamespace(module=module))
