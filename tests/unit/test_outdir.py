"""The run folder on real files: whether it may take a run, its lock (real flock), one timeline of checkpoints, and
what --overwrite deletes (only what the app wrote)."""
import json
import os
import socket

from app.checkpoint import save
from app.checkpoint import outdir
from app.checkpoint.save import MANIFEST, SAVING, complete_checkpoints, unfinished_saves


def _checkpoint(root, step, complete=True):
    """A checkpoint folder as the app leaves it: whole (manifest) or cut short (still marked as being saved)."""
    folder = root / f"step{step:08d}"
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (folder / (MANIFEST if complete else SAVING)).write_text("{}")
    return folder


def _users(root):
    """Folders the app did not write: a user's own, and one named like a checkpoint but never marked."""
    for name in ("step_keep", "step00000003"):
        (root / name).mkdir(parents=True)
        (root / name / "notes.txt").write_text("mine")
    return [root / "step_keep" / "notes.txt", root / "step00000003" / "notes.txt"]


def test_only_marked_folders_are_the_apps(tmp_path):
    root = tmp_path / "checkpoints"
    users = _users(root)
    done, cut = _checkpoint(root, 2), _checkpoint(root, 4, complete=False)
    assert complete_checkpoints(root) == [done] and unfinished_saves(root) == [cut]
    (root / "step00000006").symlink_to(done)  # a link is nobody's checkpoint: never followed, never deleted
    assert complete_checkpoints(root) == [done]
    assert all(p.read_text() == "mine" for p in users)


def test_output_dir_check(tmp_path):
    new = tmp_path / "new"
    assert outdir.check(new, overwrite=False) == "" and new.is_dir()
    assert not [p for p in new.iterdir()], "the write probe leaves nothing"
    _checkpoint(new / "checkpoints", 2)
    problem = outdir.check(new, overwrite=False)
    assert problem.startswith(f"output directory {new} already holds a run (1 checkpoint(s))"), problem
    (new / "metrics.csv").write_text("step\n")
    problem = outdir.check(new, overwrite=False)
    assert problem.startswith(f"output directory {new} already holds a run (metrics.csv, 1 checkpoint(s))")
    assert "--overwrite" in problem and "--resume auto" in problem
    assert outdir.check(new, overwrite=True) == "" and outdir.check(new, overwrite=False, resume=True) == ""
    (tmp_path / "a-file").write_text("")
    assert outdir.check(tmp_path / "a-file" / "run", overwrite=False).startswith(
        f"cannot write to output directory {tmp_path / 'a-file' / 'run'}")


def test_a_second_run_is_refused_naming_the_first_and_a_dead_runs_lock_is_taken_over(tmp_path):
    lock = tmp_path / outdir.LOCK
    assert outdir.lock(tmp_path) == ("", "")
    assert json.loads(lock.read_text()) == {"host": socket.gethostname(), "pid": os.getpid()}
    problem, _ = outdir.lock(tmp_path)  # another open file of the same lock: as a second process would be
    assert problem == (f"output directory {tmp_path} is in use by another run (host {socket.gethostname()}, pid "
                       f"{os.getpid()}); wait for it to end, or pick another --output_dir")
    outdir.unlock()
    assert not lock.exists()
    lock.write_text(json.dumps({"host": "node-7", "pid": 4242}))  # left by a run that was killed
    assert outdir.lock(tmp_path) == ("", "note: took over the lock of a run that ended without releasing it "
                                         "(host node-7, pid 4242)")
    outdir.unlock()
    lock.symlink_to(tmp_path / "elsewhere")  # planted: never followed
    assert outdir.lock(tmp_path)[0].startswith(f"cannot lock output directory {tmp_path}")
    assert not (tmp_path / "elsewhere").exists()


def test_default_run_folders_stay_in_runs():
    for dataset in ("../x.txt", "/data/corpus/", "a/../../b.jsonl"):
        name = outdir.default_name(dataset, "org/model")
        assert name.startswith("runs/") and ".." not in name and name.count("/") == 1, name


def test_resuming_an_older_checkpoint_in_place_or_into_another_run_needs_overwrite(tmp_path):
    run = tmp_path / "run"
    two, four = _checkpoint(run / "checkpoints", 2), _checkpoint(run / "checkpoints", 4)
    assert outdir.check_timeline(run, four, overwrite=False) == ""
    problem = outdir.check_timeline(run, two, overwrite=False)
    assert "would leave step00000004 of the same run" in problem and "--overwrite" in problem
    other = _checkpoint(tmp_path / "other" / "checkpoints", 9)
    assert "already holds another run (2 checkpoint(s))" in outdir.check_timeline(run, other, overwrite=False)
    assert outdir.check_timeline(tmp_path / "empty", other, overwrite=False) == ""
    assert outdir.check_timeline(run, two, overwrite=True) == ""


def test_overwrite_deletes_the_earlier_timeline_and_nothing_of_the_users(tmp_path, capsys):
    run = tmp_path / "run"
    root = run / "checkpoints"
    users = _users(root)
    two = _checkpoint(root, 2)
    _checkpoint(root, 4), _checkpoint(root, 6, complete=False)
    (root / "universal" / "step00000004").mkdir(parents=True)
    save.atomic_write(root / "latest", "step00000004")
    outdir.clear(run, two, overwrite=True)  # resumed in place from step 2: 4 and the cut-short 6 go
    assert [p.name for p in root.glob("step0*")] == ["step00000002", "step00000003"]
    assert (root / "latest").read_text() == "step00000002" and not (root / "universal" / "step00000004").exists()
    assert "overwrite: deleted 2 file(s) and folder(s) of the earlier timeline" in capsys.readouterr().out
    for name in ("metrics.csv", "summary.json", "loss.png", "mine.txt"):
        (run / name).write_text("x")
    outdir.clear(run, None, overwrite=True)  # a fresh run: the whole earlier run goes
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "mine.txt"]
    assert not (root / "latest").exists() and complete_checkpoints(root) == []
    assert all(p.read_text() == "mine" for p in users)
    assert "metrics.csv, summary.json, loss.png, step00000002" in capsys.readouterr().out


def test_overwrite_resuming_at_another_world_size_keeps_the_checkpoint_it_resumes(tmp_path, capsys):
    """At another world size the run resumes the universal copy of a checkpoint of its own (checkpoints/universal/
    step4): that is resuming in place, so only later checkpoints go, and the run's metrics stay."""
    run = tmp_path / "run"
    root = run / "checkpoints"
    _checkpoint(root, 2), _checkpoint(root, 4), _checkpoint(root, 6)
    copy = root / "universal" / "step00000004"
    copy.mkdir(parents=True)
    (run / "metrics.csv").write_text("step\n")
    outdir.clear(run, copy, overwrite=True)
    assert [p.name for p in complete_checkpoints(root)] == ["step00000002", "step00000004"] and copy.is_dir()
    assert (run / "metrics.csv").is_file() and (root / "latest").read_text() == "step00000004"
    assert "of the earlier timeline in" in capsys.readouterr().out


def test_overwrite_drops_keep_best_s_pointer_only_when_its_checkpoint_goes(tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    two, _ = _checkpoint(root, 2), _checkpoint(root, 4)
    save.atomic_write(root / "best", "step00000002")
    outdir.clear(run, two, overwrite=True)  # resumed in place from step 2, the best: it stays named
    assert (root / "best").read_text() == "step00000002"
    _checkpoint(root, 4)
    save.atomic_write(root / "best", "step00000004")
    outdir.clear(run, two, overwrite=True)  # the best was a later one: its name goes with it
    assert not (root / "best").exists()
