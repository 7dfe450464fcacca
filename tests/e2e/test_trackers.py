"""A run with --report_to wandb,mlflow (W&B offline, MLflow in a local SQLite file): each tracker holds the rows of
metrics.csv at their steps, and no api key, from the ds_config or the environment, lands in the run's files."""
from pathlib import Path

import pytest

from conftest import config_variant, read_metrics, train
from unit.test_trackers import wandb_records

COMET_KEY = "comet0e2e0secret0key0000000000000000000"
WANDB_KEY = "wandb0e2e0secret0key0000000000000000000"  # W&B's length (40); offline, never checked


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """(output_dir, the folder of all it wrote (W&B's folder too), MLflow's store URI, the run's output) of one short
    run reporting to both, its ds_config holding Comet's api_key (in a section left off), the environment W&B's."""
    tmp = tmp_path_factory.mktemp("trackers")
    (tmp / "config").mkdir()
    config = config_variant(tmp / "config", "dp", comet={"enabled": False, "api_key": COMET_KEY})
    (tmp / "written").mkdir()  # all the run writes: its output_dir, W&B's folder, MLflow's store
    store = f"sqlite:///{tmp}/written/mlflow.db"
    result = train("python", 1, "--deepspeed_config", config, "--max_steps", 4, "--log_interval", 1,
                   "--eval_interval", 2, "--save_interval", 2, "--report_to", "wandb,mlflow",
                   "--output_dir", tmp / "written" / "run", WANDB_MODE="offline", WANDB_DIR=str(tmp / "written"),
                   WANDB_PROJECT="digits", WANDB_API_KEY=WANDB_KEY, MLFLOW_TRACKING_URI=store,
                   MLFLOW_EXPERIMENT_NAME="trackers-e2e")
    return tmp / "written" / "run", tmp / "written", store, result.stdout + result.stderr


def _wandb_rows(folder: Path) -> list:
    """The history rows of the one W&B offline run under folder, read by W&B's own reader."""
    records = wandb_records(folder)
    assert next(r["exit"] for r in records if r["type"] == "exit").get("exit_code", 0) == 0, "the run finished"
    assert next(r["run"] for r in records if r["type"] == "run")["project"] == "digits"
    return [r["history"]["item"] for r in records if r["type"] == "history"]


def _pairs(rows: list, key: str) -> list:
    """(step, value) of the rows that hold key."""
    return [(int(r["step"]), r[key]) for r in rows if r.get(key) is not None]


def _same(got: list, expected: list) -> bool:
    """The same steps, and values the same but for metrics.csv's rounding (8 significant digits)."""
    return [s for s, _ in got] == [s for s, _ in expected] and \
        all(abs(a - b) <= 1e-7 * abs(b) for (_, a), (_, b) in zip(got, expected))


def test_wandb_and_mlflow_hold_the_runs_loss_and_eval_loss_at_each_logged_step(tracked):
    output_dir, wandb_dir, store, _ = tracked
    train_rows, eval_rows = read_metrics(output_dir)
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4] and [r["step"] for r in eval_rows] == [2, 4]
    rows = _wandb_rows(wandb_dir)
    assert _same(_pairs(rows, "loss"), _pairs(train_rows, "loss")), rows
    assert _same(_pairs(rows, "eval_loss"), _pairs(eval_rows, "eval_loss")), rows
    assert all("Train/Samples/lr" in r for r in rows), "DeepSpeed's own events beside the app's rows"
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("trackers-e2e").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].info.run_name == "run"
    run_id = runs[0].info.run_id
    for key, expected in (("loss", train_rows), ("eval_loss", eval_rows)):
        history = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        assert _same(sorted(history), _pairs(expected, key)), history
    assert runs[0].data.params["max_steps"] == "4" and runs[0].data.params["report_to"] == "wandb,mlflow"


def test_no_api_key_lands_in_the_runs_files_nor_its_output(tracked):
    output_dir, written, _, output = tracked
    files = [p for p in output_dir.rglob("*") if p.is_file()]
    assert any(p.name == "trainer_state.json" for p in files), "a checkpoint, with the run's DeepSpeed dict, was saved"
    for key in (COMET_KEY, WANDB_KEY):
        assert not [str(p) for p in files if key.encode() in p.read_bytes()]
        assert key not in output
    assert not [str(p) for p in written.rglob("*") if p.is_file() and COMET_KEY.encode() in p.read_bytes()], \
        "nor in W&B's run or MLflow's store"
