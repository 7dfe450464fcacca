"""A full disk or a read-only folder at a save: every rank ends at once, with one line naming the folder and the
space needed and free; the last complete checkpoint stays whole and resumable. On real small filesystems the
test mounts (tmpfs, which needs root: CI runs as root)."""
import os
import subprocess
import time

import pytest

from app.checkpoint import disk
from app.checkpoint import outdir
from app.checkpoint import resume
from conftest import assert_one_error_line, faulty_command, read_metrics, run, tmpfs, train, train_command

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs, which needs root (CI runs as root; "
                                                           "`sudo make test` here)")]
RUN = ["--log_interval", 1, "--save_interval", 1]


def test_a_disk_without_room_for_the_next_checkpoint(tmp_path):
    with tmpfs(tmp_path / "small", "16m") as small:
        out = small / "run"
        train("python", 1, "--max_steps", 2, *RUN, "--output_dir", out)  # ZeRO 0: resumes at any world size
        last = out / "checkpoints" / "step00000002"
        needed = disk.folder_bytes(last)
        filler = small / "filler"  # the disk fills up: half a checkpoint's room is left
        subprocess.run(["fallocate", "-l", str(disk.free_bytes(small) - needed // 2), str(filler)], check=True)
        started = time.monotonic()
        result = run(train_command("deepspeed", 2, "--max_steps", 4, *RUN, "--output_dir", out, "--resume", "auto"))
        assert result.returncode != 0 and time.monotonic() - started < 60, "every rank ends, at once"
        line = assert_one_error_line(result.stdout + result.stderr, f"not enough space to save a checkpoint in {out / 'checkpoints'}",
                                     f"it needs about {needed / 2**20:,.1f} MB and", "MB are free",
                                     "the last complete checkpoint, step00000002, is whole", anywhere=True)
        assert "--resume auto" in line
        assert resume.verify(last).step == 2 and not (out / "checkpoints" / "step00000003").exists()
        filler.unlink()  # room again: the run continues from its last checkpoint and finishes
        resumed = train("python", 1, "--max_steps", 4, *RUN, "--output_dir", out, "--resume", "auto")
        assert "at step 2" in resumed.stdout
        assert [row["step"] for row in read_metrics(out)[0]] == [1, 2, 3, 4]


def test_a_read_only_checkpoint_folder(tmp_path):
    """The write itself fails (the folder has room): every rank hears it from rank 0 at once, none waiting for the
    others (a rank that failed alone waits APP_PATIENCE_S, here longer than the test allows); one line from all of
    them, and no run files left, so the same command can run again once the folder is writable."""
    out = tmp_path / "run"
    with tmpfs(out / "checkpoints", "16m", read_only=True):
        result = run(faulty_command("deepspeed", 2, "--max_steps", 2, *RUN, "--output_dir", out), timeout=60,
                     APP_PATIENCE_S="120")
        assert result.returncode != 0
        assert_one_error_line(result.stdout + result.stderr, f"cannot save a checkpoint in {out / 'checkpoints'}: "
                              "read-only file system", "no checkpoint of this run was saved yet: run the same command "
                              "again", anywhere=True)
        assert "TCPStore" not in result.stderr, "rank 0 kept the store until every rank had read the outcome"
    assert outdir.check(out, overwrite=False) == ""
    train("python", 1, "--max_steps", 2, *RUN, "--output_dir", out)  # the folder takes a run again
