"""Disk space for checkpoints: bytes, free space, and the one line for a save with no room or a failed write."""
import errno
import os
import shutil

import pytest
import torch

from app.checkpoint import disk

MB = 2**20
NEEDED = 1536 * MB + MB // 2
DEV_FULL = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")


def _caught(write) -> BaseException:
    try:
        write()
    except (OSError, RuntimeError) as e:
        return e
    raise AssertionError("the write did not fail")


def _write_to_dev_full():
    with open("/dev/full", "wb") as f:
        f.write(b"\0" * 4096)


def test_a_folders_bytes_are_those_of_every_file_under_it(tmp_path):
    assert disk.folder_bytes(tmp_path) == 0
    (tmp_path / "global_step4" / "zero").mkdir(parents=True)
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1000)
    (tmp_path / "global_step4" / "zero" / "optim_states.pt").write_bytes(b"y" * 234)
    (tmp_path / "empty").mkdir()
    assert disk.folder_bytes(tmp_path) == 1234


def test_the_room_of_a_folder_not_made_yet_is_that_of_the_filesystem_it_will_be_on(tmp_path):
    later = tmp_path / "run" / "checkpoints" / "step00000002"
    assert abs(disk.free_bytes(later) - shutil.disk_usage(tmp_path).free) < 64 * MB
    assert not (tmp_path / "run").exists(), "asking makes nothing"


def test_a_save_with_room_goes_ahead(tmp_path):
    assert disk.shortfall(tmp_path, 0, "") == ""
    assert disk.shortfall(tmp_path / "not" / "made", 1, "step00000002") == ""


def test_a_save_without_room_is_one_line_with_the_space_needed_and_free(tmp_path):
    needed = disk.free_bytes(tmp_path) + 2**40
    line = disk.shortfall(tmp_path, needed, "")
    assert line.startswith(f"not enough space to save a checkpoint in {tmp_path}: it needs about "
                           f"{needed / MB:,.1f} MB and "), line
    assert " MB are free; free some space, lower --keep_last or pick an --output_dir with room; no checkpoint of " \
           "this run was saved yet: run the same command again" in line and "\n" not in line


def test_a_save_without_room_after_a_checkpoint_says_to_resume_from_it(tmp_path):
    line = disk.shortfall(tmp_path, disk.free_bytes(tmp_path) + 2**40, "step00000004")
    assert line.endswith("the last complete checkpoint, step00000004, is whole: continue from it with --resume auto")


@DEV_FULL
@pytest.mark.parametrize("write", [_write_to_dev_full, lambda: torch.save({"w": torch.ones(10_000)}, "/dev/full")],
                         ids=["python's write", "torch's zip writer, which gives no errno"])
def test_a_write_that_ran_out_of_room_says_the_disk_is_full(write, tmp_path):
    line = disk.write_failure(tmp_path, _caught(write), NEEDED, "step00000002")
    assert line.startswith(f"cannot save a checkpoint in {tmp_path}: the disk (or the quota) is full (it needs "
                           f"about 1,536.5 MB, "), line
    assert " MB free); free some space" in line and line.endswith("continue from it with --resume auto")


FULL = "the disk (or the quota) is full"


@pytest.mark.parametrize("error, why", [
    (OSError(errno.EDQUOT, "Disk quota exceeded"), FULL),
    (RuntimeError("PytorchStreamWriter failed writing file data/3: file write failed"), FULL),
    (PermissionError(errno.EACCES, "Permission denied"), "permission denied"),
    (OSError(errno.EROFS, "Read-only file system"), "read-only file system"),
    (OSError(errno.EIO, "Input/output error"), "input/output error"),
])
def test_the_filesystems_reason_is_said_in_its_own_words(error, why, tmp_path):
    line = disk.write_failure(tmp_path, error, NEEDED, "")
    assert line.startswith(f"cannot save a checkpoint in {tmp_path}: {why} (it needs about 1,536.5 MB, "), line
    assert line.endswith("no checkpoint of this run was saved yet: run the same command again")


def test_a_writer_that_does_not_say_why_has_the_folder_asked(tmp_path):
    """A refusal without an errno (torch's writer) is put to the folder with a probe file, which it leaves behind
    nowhere."""
    opening = RuntimeError("File /x/mp_rank_00_model_states.pt cannot be opened.")
    (tmp_path / "a-file").write_text("")
    assert ": not a directory (it needs" in disk.write_failure(tmp_path / "a-file", opening, NEEDED, "")
    assert ": no such file or directory (it needs" in disk.write_failure(tmp_path / "gone", opening, NEEDED, "")
    line = disk.write_failure(tmp_path, opening, NEEDED, "")
    assert f"{tmp_path}: File /x/mp_rank_00_model_states.pt cannot be opened. (it needs" in line, \
        "a folder that takes files: the writer's own words"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"], "the probe leaves nothing"


def test_a_reason_of_many_lines_or_none_is_one_line(tmp_path):
    many = disk.write_failure(tmp_path, RuntimeError("the writer stopped\n  at frame 1\n  at frame 2"), NEEDED, "")
    assert ": the writer stopped (it needs" in many and "\n" not in many
    assert f"{tmp_path}: RuntimeError (it needs" in disk.write_failure(tmp_path, RuntimeError(""), NEEDED, "")
