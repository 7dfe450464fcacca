"""Checkpoints end to end: crash-safe saves, exact resume after kills, world size changes, refusal of bad
checkpoints (the unit tests of the state and of resume on hand-written folders are in tests/unit/test_resume.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from app.checkpoint.save import sha256_of
from app.tools.export import fp32_state_dict
from conftest import (FAULTS, REPO, TWO_RANK_ARGS, TWO_RANK_STEPS, assert_one_error_line, faulty_command,
                      launch_script, read_metrics, run, train, train_command, train_jobs, two_rank_steps)


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
def killed_before(tmp_path_factory):
    """(name -> (exit code, complete checkpoints, latest) when killed, name -> the job resuming it, root): each
    config's run killed by itself, its ranks started as launch_script starts them (a kill through the deepspeed
    launcher: test_preemption.py), the rank left alone waiting 1 s, not 5, for the dead one's outcome
    (APP_PATIENCE_S); the resumptions run in the launch of two_rank_runs."""
    root, killed = tmp_path_factory.mktemp("killed"), {}
    for name, (moment, _) in sorted(KILLS.items()):
        config = REPO / "ds_configs" / f"{name}.json"
        result = launch_script(2, FAULTS, "app/train.py", "--deepspeed_config", config, *TWO_RANK_ARGS,
                               "--output_dir", root / name, APP_KILL_AT=moment, APP_PATIENCE_S="1")
        complete = sorted(p.parent.name for p in (root / name / "checkpoints").glob("step*/manifest.json"))
        killed[name] = result.returncode, complete, (root / name / "checkpoints" / "latest").read_text()
    resumed = {name: ["--deepspeed_config", REPO / "ds_configs" / f"{name}.json", *TWO_RANK_ARGS, "--output_dir",
                      root / name, "--resume", "auto"] for name in killed}
    return killed, resumed, root


def _ten_steps(name: str, out, steps: int = 10, *resume) -> list:
    return ["--deepspeed_config", REPO / "ds_configs" / f"{name}.json", "--max_steps", steps, "--log_interval", 1,
            "--output_dir", out, *resume]


@pytest.fixture(scope="module")
def world_size_runs(tmp_path_factory):
    """(2-rank jobs, output folders) of the world-size changes: zero2's first 10 steps on 2 ranks; zero3's first
    10 on one process (run here), resumed to 20 on 2 ranks."""
    root = tmp_path_factory.mktemp("world-size")
    train("python", 1, *_ten_steps("zero3", root / "zero3"))
    jobs = {"zero2": _ten_steps("zero2", root / "zero2"),
            "zero3": _ten_steps("zero3", root / "zero3", 20, "--resume", "auto")}
    return jobs, {name: root / name for name in jobs}


@pytest.fixture(scope="module")
def two_rank_runs(killed_before, world_size_runs):
    """The 2-rank runs of this file that need no launch of their own, one after another in one launch:
    tag -> stdout ("resumed <name>" for the killed runs, "world <name>" for the world-size changes)."""
    jobs = {**{f"resumed {name}": job for name, job in killed_before[1].items()},
            **{f"world {name}": job for name, job in world_size_runs[0].items()}}
    return dict(zip(jobs, train_jobs("ranks", 2, list(jobs.values()))))


@pytest.fixture(scope="module")
def killed_then_resumed(killed_before, two_rank_runs):
    """name -> ((exit code, complete checkpoints, latest) when killed, resumed run's stdout, output_dir)."""
    killed, _, root = killed_before
    return {name: (killed[name], two_rank_runs[f"resumed {name}"], root / name) for name in killed}


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


def test_half_written_checkpoints_are_cleared(tmp_path):
    """A folder left by a killed save is removed by the next whole save, not kept forever."""
    out = tmp_path / "run"
    run(faulty_command("python", 1, "--max_steps", 6, "--save_interval", 2, "--output_dir", out),
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


def test_resume_takes_a_run_folder_and_refuses_what_is_not_a_checkpoint(saved_run, tmp_path):
    """Users have the run folder at hand: --resume takes it, naming the checkpoint it picks, and continues in it."""
    moved, _ = _copy(saved_run, tmp_path)
    result = train("python", 1, "--max_steps", 6, "--save_interval", 2, "--resume", moved)
    assert f"resume: the newest complete checkpoint of {moved} is step00000004" in result.stdout
    assert "at step 4" in result.stdout and (moved / "checkpoints" / "step00000006" / "manifest.json").is_file()
    result = run(train_command("python", 1, "--output_dir", tmp_path / "x", "--resume", tmp_path / "nope"))
    _fails(result, "no such folder")
    (tmp_path / "plain").mkdir()
    result = run(train_command("python", 1, "--output_dir", tmp_path / "x", "--resume", tmp_path / "plain"))
    _fails(result, "is not a complete checkpoint")
    copied = tmp_path / "copied" / "step00000004"  # a checkpoint away from its run: where to write is not known
    copied.parent.mkdir()
    subprocess.run(["cp", "-r", str(saved_run / "checkpoints" / "step00000004"), str(copied)], check=True)
    _fails(run(train_command("python", 1, "--resume", copied)), f"{copied} is not inside the run folder that made it")
    assert list(copied.parent.iterdir()) == [copied], "nothing written beside it"


@pytest.mark.parametrize("args, text", [
    (["--model", "mlp"], "was made with model='cnn' but this run has model='mlp'"),
    (["--deepspeed_config", REPO / "ds_configs" / "zero2.json"], "zero_stage=0 but this run has zero_stage=2"),
])
def test_checkpoint_of_another_setup_is_refused(args, text, saved_run, tmp_path):
    copy, before = _copy(saved_run, tmp_path)
    result = run(train_command("python", 1, *args, "--max_steps", 6, "--output_dir", copy, "--resume", "auto"))
    _fails(result, text)
    _untouched(before)


def test_resume_auto_without_checkpoints_starts_fresh(saved_run):
    stdout = (saved_run.parent / "stdout.txt").read_text()
    assert "no complete checkpoint" in stdout and "starting fresh" in stdout
    manifest = json.loads((saved_run / "checkpoints" / "step00000004" / "manifest.json").read_text())
    assert {"mp_rank_00_model_states.pt", "trainer_state.json", "rng_rank00000.json"} <= set(manifest)
    assert (saved_run / "checkpoints" / "latest").read_text() == "step00000004"


@pytest.mark.parametrize("name, before, after", [("zero2", 2, 1), ("zero3", 1, 2)])
def test_resume_at_another_world_size(name, before, after, world_size_runs, two_rank_runs):
    """ZeRO state saved by N ranks continues on M ranks through a universal checkpoint."""
    out = world_size_runs[1][name]
    stdout = train("python", 1, *_ten_steps(name, out, 20, "--resume", "auto")).stdout if after == 1 else \
        two_rank_runs[f"world {name}"]
    assert f"saved by {before} rank(s), this run has {after}: converting it to a universal checkpoint" in stdout
    assert "at step 10" in stdout
    rows = read_metrics(out)[0]
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert rows[-1]["loss"] < rows[9]["loss"] < rows[0]["loss"], "training goes on from where it was"
    assert json.loads((out / "summary.json").read_text())["world_size"] == after


# -- without an engine: checkpoint folders written by hand ---------------------------------------------------


class Payload:
    """Pickled as a call of os.system: loading it as a pickle creates the file."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_file_carrying_code_is_refused_and_nothing_runs(saved_run, tmp_path):
    """Whoever writes the files writes the manifest: a shard that would run code, sealed by a manifest of its own,
    is refused in one line naming it by resume, export and the universal conversion, and never runs."""
    crafted, _ = _copy(saved_run, tmp_path)
    folder, marker = crafted / "checkpoints" / "step00000004", tmp_path / "the-pickle-ran"
    shard = folder / "mp_rank_00_model_states.pt"
    torch.save({"module": Payload(marker)}, shard)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest[shard.name] = {"size": shard.stat().st_size, "sha256": sha256_of(shard)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    resumed = run(train_command("python", 1, "--max_steps", 6, "--output_dir", crafted, "--resume", "auto"))
    _fails(resumed, f"{shard} is not a file of tensors and plain values (it names posix.system)")
    exported = run([sys.executable, "-m", "app.tools.export", crafted, tmp_path / "x.safetensors"])
    _fails(exported, f"{shard} is not a file of tensors and plain values")
    torch.save({"optimizer_state_dict": Payload(marker)}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    converted = run([sys.executable, "-m", "app.ds.internals.universal", "--input_folder", folder, "--output_folder",
                     tmp_path / "universal", "--num_extract_workers", "1", "--num_merge_workers", "1"])
    _fails(converted, "nothing of it ran")
    assert not marker.exists(), "the checkpoint's code ran"


def test_overwrite_leaves_one_timeline_and_the_users_folders(saved_run, tmp_path):
    """--overwrite after a longer run deletes that run's checkpoints (saying so), so keep-last and latest see this
    run's alone; folders under checkpoints/ the app did not mark as its own stay."""
    out, _ = _copy(saved_run, tmp_path)
    mine = out / "checkpoints" / "step_keep" / "notes.txt"
    mine.parent.mkdir()
    mine.write_text("mine")
    result = train("python", 1, "--max_steps", 2, "--save_interval", 1, "--keep_last", 2, "--output_dir", out,
                   "--overwrite")
    assert "overwrite: deleted" in result.stdout and "step00000004" in result.stdout
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step00000001", "step00000002", "step_keep"]
    latest = root / (root / "latest").read_text()
    assert latest.name == "step00000002" and (latest / "manifest.json").is_file()
    assert json.loads((latest / "trainer_state.json").read_text())["settings"]["max_steps"] == 2, "this run's"
    assert mine.read_text() == "mine" and [r["step"] for r in read_metrics(out)[0]] == [2.0], "no row of the old run"


def test_a_monitors_key_in_the_json_stays_out_of_the_checkpoint(tmp_path):
    """DeepSpeed copies the dict it was built from into its own files, and the trainer state holds it too: Comet's
    key goes to COMET_API_KEY before the engine is built (app/observe/trackers.py), so neither holds it."""
    ds = json.loads((REPO / "ds_configs" / "dp.json").read_text())
    ds["comet"] = {"enabled": False, "api_key": "KEY-8f3a1c", "project": "p"}
    (tmp_path / "with_key.json").write_text(json.dumps(ds))
    out = tmp_path / "run"
    train("python", 1, "--deepspeed_config", tmp_path / "with_key.json", "--max_steps", 2, "--save_interval", 2,
          "--output_dir", out)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert not [p for p in files if b"KEY-8f3a1c" in p.read_bytes()]
    assert any(b"comet" in p.read_bytes() for p in files if p.suffix == ".pt"), \
        "DeepSpeed's copy of the dict is there, its comet section without the key"
    state = json.loads(next(out.rglob("trainer_state.json")).read_text())
    assert state["deepspeed_config"]["comet"] == {"enabled": False, "project": "p"}
