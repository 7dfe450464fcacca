"""Early stopping and --keep_best on 2 ranks: a run whose evaluation loss rises stops as a finished run, keeps its
best checkpoint, continues its count when resumed, and its best checkpoint resumes. The rules: unit/test_early_stop.py."""
import json

import numpy as np
import pytest
from PIL import Image

from conftest import read_metrics, read_summary, train_jobs

PATIENCE = 3


def random_labels(root, per_class: int = 24, side: int = 16):
    """An image folder of noise whose classes mean nothing: a model can only learn its training images by heart,
    so after a few steps its held-out loss rises."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", per_class // 2)):
        for label in "abcd":
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def test_a_run_whose_eval_loss_rises_stops_keeps_its_best_and_resumes(tmp_path):
    images, run = random_labels(tmp_path / "images"), tmp_path / "run"
    args = ["--model", "mlp", "--dataset", "imagefolder", "--data_dir", images, "--image_size", 16, "--max_steps", 60,
            "--eval_interval", 2, "--log_interval", 2, "--keep_best", "--keep_last", 1]
    first, = train_jobs("ranks", 2, [[*args, "--early_stopping_patience", PATIENCE, "--output_dir", run]])
    summary = read_summary(run)
    early, stopped = summary["early_stopping"], summary["steps"]
    evals = {int(r["step"]): r["eval_loss"] for r in read_metrics(run)[1]}
    best = min(evals, key=evals.get)
    assert early.pop("why") == f"eval_loss has not improved for {PATIENCE} evaluation(s) (best " \
        f"{early['best']:.6g} at step {best})"
    assert early == {"metric": "eval_loss", "mode": "min", "best": pytest.approx(evals[best], rel=1e-7),
                     "best_step": best, "bad": PATIENCE, "stopped": True}, "metrics.csv holds 8 digits"
    assert stopped == best + 2 * PATIENCE < 60, "it stopped at the third evaluation without improvement"
    assert f"stopped early at step {stopped}, eval_loss has not improved for {PATIENCE} evaluation(s)" in first
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step*")) == [f"step{best:08d}", f"step{stopped:08d}"], \
        "the newest (--keep_last 1) and the best"
    assert (checkpoints / "best").read_text() == f"step{best:08d}"
    state = json.loads((checkpoints / f"step{stopped:08d}" / "trainer_state.json").read_text())
    assert state["early_stopping"] == {k: v for k, v in early.items() if k != "stopped"}

    more, again, from_best = train_jobs("ranks", 2, [
        [*args, "--early_stopping_patience", PATIENCE + 2, "--resume", "auto", "--output_dir", run],
        [*args, "--early_stopping_patience", PATIENCE + 2, "--resume", "auto", "--output_dir", run],
        [*args, "--max_steps", best + 2, "--resume", checkpoints / f"step{best:08d}", "--output_dir",
         tmp_path / "from_best"]])
    assert read_summary(run)["early_stopping"]["bad"] == PATIENCE + 2
    assert read_summary(run)["steps"] == stopped + 4, "the count went on from 3: two more evaluations, not five"
    assert "nothing to do: this run stopped early, eval_loss has not improved for 5 evaluation(s)" in again
    resumed = read_metrics(tmp_path / "from_best")[0]
    assert [int(r["step"]) for r in resumed] == [best + 2], "the best checkpoint resumes at its step"
    assert read_summary(tmp_path / "from_best")["steps"] == best + 2


def test_a_run_judged_at_epoch_ends_saves_the_stopping_verdict_and_resumes_with_nothing_to_do(tmp_path):
    """Evaluated at each epoch's end (no --eval_interval) and saved at every step: the epoch's last step is saved
    after its evaluation, so the checkpoint holds the evaluation that stopped the run (and a new best is kept)."""
    images, run = random_labels(tmp_path / "images"), tmp_path / "run"
    args = ["--model", "mlp", "--dataset", "imagefolder", "--data_dir", images, "--image_size", 16, "--epochs", 40,
            "--log_interval", 1, "--save_interval", 1, "--keep_best", "--keep_last", 1, "--early_stopping_patience", 2,
            "--output_dir", run]
    first, again = train_jobs("ranks", 2, [args, [*args, "--resume", "auto"]])
    early, stopped = read_summary(run)["early_stopping"], read_summary(run)["steps"]
    assert early["stopped"] and f"stopped early at step {stopped}," in first, first[:6000]
    state = json.loads((run / "checkpoints" / f"step{stopped:08d}" / "trainer_state.json").read_text())
    assert state["early_stopping"] == {k: v for k, v in early.items() if k not in ("stopped", "why")}
    assert state["early_stopping"]["bad"] == 2 and state["batch"] == 0, "the next epoch's start, its verdict in"
    assert (run / "checkpoints" / "best").read_text() == f"step{early['best_step']:08d}"
    assert "nothing to do: this run stopped early, eval_loss has not improved for 2 evaluation(s)" in again
