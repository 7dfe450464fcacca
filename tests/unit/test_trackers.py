"""The trackers (app/observe/trackers.py): --report_to and the DeepSpeed dict's monitor sections, the one line for a
tracker that cannot start, and each metrics.csv row read back from W&B's offline run, DeepSpeed's CSV files and a
local MLflow store."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist

from conftest import REPO
from app.ds import auto as ds_auto
from app.ds import run_dict
from app.errors import UserError
from app.observe import runlog, trackers
from app.redact import REDACTED
from app.settings import Settings


def test_report_to_names_trackers_and_an_unknown_name_is_one_line():
    assert trackers.asked(" wandb,MLflow, none,tensorboard,wandb") == ("wandb", "mlflow")
    assert trackers.asked("") == ()
    with pytest.raises(UserError, match=r"--report_to: unknown tracker 'neptune'; name any of wandb, comet, mlflow"):
        trackers.asked("wandb,neptune")


def test_report_to_turns_deepspeeds_sections_on_keeping_what_the_json_sets(monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "digits")
    given = {"comet": {"enabled": False, "workspace": "team", "samples_log_interval": 50}}
    ds = trackers.with_sections(given, ("wandb", "comet", "mlflow"))
    assert ds["wandb"] == {"enabled": True, "project": "digits"}, "W&B's project from the environment"
    assert ds["comet"] == {"enabled": True, "workspace": "team", "samples_log_interval": 50}
    assert trackers.with_sections({}, ("comet",))["comet"] == {"enabled": True, "samples_log_interval": 1}
    assert given["comet"]["enabled"] is False, "the JSON's dict is kept"
    own = {"wandb": {"enabled": True, "project": "mine"}, "csv_monitor": {"enabled": True}}
    assert trackers.with_sections(own, ()) == own, "a project the JSON names stays"
    assert trackers.with_sections({}, ("mlflow",)) == {}, "MLflow is the app's own: no DeepSpeed section"


def test_comets_api_key_leaves_the_dict_for_comets_own_variable(monkeypatch):
    monkeypatch.setenv("COMET_API_KEY", "before")  # restored after the test
    ds = trackers.enabled({"train_batch_size": 8, "comet": {"enabled": False, "api_key": "s3cret"}}, "")
    assert ds == {"train_batch_size": 8, "comet": {"enabled": False}}
    assert os.environ["COMET_API_KEY"] == "s3cret"


def test_trial_reference_and_benchmark_engines_report_nothing():
    """A micro batch trial, a frozen reference or a benchmark mode would start a W&B run of its own: only the
    run's engine reports."""
    monitors = {"wandb": {"enabled": True}, "csv_monitor": {"enabled": True}, "tensorboard": {"enabled": True}}
    ds, filled, _ = run_dict.planned({"train_micro_batch_size_per_gpu": 4, **monitors}, "j.json",
                                     torch.device("cpu"), 1, ds_auto.Facts())
    assert not set(monitors) & set(run_dict.for_trial(ds, 2, 1))
    assert not set(monitors) & set(run_dict.for_reference(ds, 1))
    benchmark, _ = run_dict.for_benchmark({"train_micro_batch_size_per_gpu": 4, **monitors}, 2, ds_auto.Facts(), 1, 4,
                                          "a benchmark")
    assert not set(monitors) & set(benchmark)
    final = run_dict.final(ds, filled, 10, universal=False, trainable=100, tensor=1)
    assert {key: final[key] for key in monitors} == monitors


FAKES = {"wandb/__init__.py": "raise ImportError('wandb is broken here')\n",
         "mlflow/__init__.py": "raise ImportError('no mlflow here')\n",
         "comet_ml/__init__.py": "__version__ = '3.40.1'\n"}
CASES = [({}, "wandb"), ({"wandb": {"enabled": True}}, ""), ({}, "mlflow"), ({"comet": {"enabled": True}}, "comet")]


def test_a_tracker_whose_package_does_not_import_is_one_line_saying_what_to_install(tmp_path):
    """Packages that fail to import, put first on the path of a fresh python."""
    for path, text in FAKES.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    script = "\n".join(["import json, sys", "from app.errors import UserError", "from app.observe import trackers",
                        "said = []", "for ds, report_to in json.loads(sys.argv[1]):", "    try:",
                        "        trackers.enabled(ds, report_to)", "        said.append('')",
                        "    except UserError as e:", "        said.append(str(e))", "print(json.dumps(said))"])
    done = subprocess.run([sys.executable, "-c", script, json.dumps(CASES)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert said == [
        "--report_to wandb needs the wandb package, which does not import (wandb is broken here): "
        "pip install -r requirements-trackers.txt",
        "the DeepSpeed config's \"wandb\" section needs the wandb package, which does not import (wandb is broken "
        "here): pip install -r requirements-trackers.txt",
        "--report_to mlflow needs the mlflow package, which does not import (no mlflow here): "
        "pip install -r requirements-trackers.txt",
        "--report_to comet needs comet_ml 3.41.0 or later, not 3.40.1: pip install \"comet_ml>=3.41.0\""]


def test_an_mlflow_store_that_cannot_open_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path}/mlruns")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(UserError) as said:
        trackers.enabled({}, "mlflow")
    line = str(said.value)
    assert line.startswith(f"--report_to mlflow: MLflow cannot use its store file:{tmp_path}/mlruns (")
    assert "MLFLOW_ALLOW_FILE_STORE" in line and "\n" not in line, "MLflow's own reason, in the one line"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://alice:s3cr3t@127.0.0.1:1/mlflow")  # MLflow's own form
    with pytest.raises(UserError) as said:
        trackers.enabled({}, "mlflow")
    assert "s3cr3t" not in str(said.value) and "postgresql://alice:<redacted>@127.0.0.1:1/mlflow" in str(said.value)


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A process group of this process alone, adopted by DeepSpeed as a run's is (its monitors ask it for the
    rank); W&B offline in tmp_path, MLflow in a folder there (its quickest store to start)."""
    from app.distributed.launch import prepare_environment
    import deepspeed
    prepare_environment()  # this Python's ninja: DeepSpeed's CPU comm op loads as built, not rebuilt
    for name, value in dict(MLFLOW_TRACKING_URI=f"file:{tmp_path}/mlruns", MLFLOW_ALLOW_FILE_STORE="true",
                            WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_CONSOLE="off", WANDB_SILENT="true",
                            WANDB_PROJECT="digits").items():
        monkeypatch.setenv(name, value)
    torch_dist.init_process_group("gloo", store=torch_dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                                  world_size=1)
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
    yield
    import wandb
    wandb.teardown()
    torch_dist.destroy_process_group()


class Engine:
    """What of an engine the trackers read, and what its step writes to its monitor: DeepSpeed's MonitorMaster of
    the dict (as DeepSpeedEngine builds it), its samples count, and its learning rate event at each optimizer
    step (engine.step's)."""

    def __init__(self, ds: dict, batch: int):
        from deepspeed.monitor.config import get_monitor_config
        from deepspeed.monitor.monitor import MonitorMaster
        self.monitor, self.global_samples, self.batch = MonitorMaster(get_monitor_config(ds)), 0, batch

    def step(self, lr: float):
        self.global_samples += self.batch
        self.monitor.write_events([("Train/Samples/lr", lr, self.global_samples)])


def _train(log, engine, steps: int):
    for step in range(1, steps + 1):
        engine.step(0.1 * step)
        log.train_row(step, 0, 3.0 - 0.5 * step, 0.1 * step, samples=32, seconds=0.5)
        if step % 2 == 0:
            log.write_row({"step": step, "epoch": 0, "eval_loss": 2.0 / step, "eval_accuracy": 0.25 * step})


def wandb_records(folder: Path) -> list:
    """The records of the one W&B offline run under folder, read by W&B's own reader."""
    found = list(folder.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(found) == 1, found
    done = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(found[0])],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _mlflow_run(name: str):
    from mlflow import MlflowClient
    client = MlflowClient()
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"attributes.run_name = '{name}'")
    assert len(runs) == 1, runs
    run = runs[0]
    return run, {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
                 for key in ("loss", "eval_loss", "lr", "epoch")}  # MLflow keeps no order among a run's values


def test_each_row_reaches_wandb_deepspeeds_csv_files_and_mlflow_at_its_step(tmp_path, one_rank):
    ds = trackers.enabled({"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"),
                                           "job_name": "job"}}, "wandb,mlflow")
    engine = Engine(ds, batch=32)
    settings = Settings(report_to="wandb,mlflow", max_steps=4)
    log = runlog.RunLog(tmp_path / "run", 4, show_progress=False, trackers=trackers.for_run(engine, settings, "run"))
    _train(log, engine, 4)
    log.finish({"steps": 4})
    records = wandb_records(tmp_path)
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(row["step"], row["_step"], row["loss"]) for row in rows] == [(1, 32, 2.5), (2, 64, 2.0), (3, 96, 1.5),
                                                                           (4, 128, 1.0)], "not one row dropped"
    assert [(row["step"], row["eval_loss"]) for row in rows if "eval_loss" in row] == [(2, 1.0), (4, 0.5)]
    assert all(row["Train/Samples/lr"] == row["lr"] for row in rows), "DeepSpeed's own events beside the rows"
    plotted = {r["metric"]["name"]: r["metric"].get("step_metric") for r in records if r["type"] == "metric"}
    assert plotted["loss"] == plotted["eval_loss"] == "step"
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["project"] == "digits"
    assert next(r["exit"] for r in records if r["type"] == "exit").get("exit_code", 0) == 0
    csv_rows = (tmp_path / "csv" / "job" / "eval_loss.csv").read_text().split()
    assert csv_rows == ["step,eval_loss", "64,1.0", "128,0.5"], "DeepSpeed's CSV files count samples"
    found, metrics = _mlflow_run("run")
    assert found.info.status == "FINISHED"
    assert metrics["loss"] == [(1, 2.5), (2, 2.0), (3, 1.5), (4, 1.0)] and metrics["eval_loss"] == [(2, 1.0), (4, 0.5)]
    assert metrics["epoch"][0] == (1, 0.0)
    assert found.data.params["max_steps"] == "4" and found.data.params["report_to"] == "wandb,mlflow"


def test_a_run_that_fails_ends_its_tracker_runs_as_failed(tmp_path, one_rank):
    engine = Engine(trackers.enabled({}, "wandb,mlflow"), batch=8)
    params = {"model": "cnn", "hf_token": "hf_s3cret", "layers": [1, 2], "tokenizer": ""}
    log = runlog.RunLog(tmp_path / "run", 4, show_progress=False,
                        trackers=trackers.Trackers(engine.monitor, lambda: engine.global_samples, params, "failed"))
    with pytest.raises(RuntimeError, match="disk on fire"):
        with log.discarded_on_error(lambda: False):
            _train(log, engine, 2)
            raise RuntimeError("disk on fire")
    assert not (tmp_path / "run" / "metrics.csv").exists(), "the fresh run's files go"
    found, metrics = _mlflow_run("failed")
    assert found.info.status == "FAILED" and metrics["loss"] == [(1, 2.5), (2, 2.0)]
    assert found.data.params == {"model": "cnn", "hf_token": REDACTED, "layers": "[1, 2]", "tokenizer": ""}
    records = wandb_records(tmp_path)
    assert next(r["exit"] for r in records if r["type"] == "exit")["exit_code"] == 1
    assert [r["history"]["item"]["loss"] for r in records if r["type"] == "history"] == [2.5, 2.0]



WANDB_LOGINS = '''
import json, os
from app.errors import UserError
from app.observe import trackers
said = []
for env in ({}, {"WANDB_MODE": "offline"}, {"WANDB_MODE": "disabled"}, {"WANDB_API_KEY": "short"},
            {"WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567"}):
    os.environ.update(env)
    try:
        trackers.enabled({"wandb": {"enabled": True, "project": "x"}}, "")
        said.append("")
    except UserError as e:
        said.append(str(e))
    for name in env:
        del os.environ[name]
print(json.dumps(said))
'''


def test_wandb_online_without_a_login_is_one_line_before_the_engine_starts_it(tmp_path):
    """W&B's own search for a key (the environment, the .netrc `wandb login` writes, its settings), here a home
    without any: no prompt, no call out, and offline or disabled need none."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "NETRC"))}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "config"), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", WANDB_LOGINS], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    no_login, offline, disabled, bad_key, key = json.loads(done.stdout.splitlines()[-1])
    assert no_login == ("the DeepSpeed config's \"wandb\" section: W&B runs online (WANDB_MODE) and finds no login "
                        "on this machine; run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline (then "
                        "`wandb sync`) or disabled")
    assert (offline, disabled, key) == ("", "", "")
    assert bad_key == ("the DeepSpeed config's \"wandb\" section: W&B refuses its login here (API key must have "
                       "40+ characters, has 5.); run `wandb login` again or fix WANDB_API_KEY")
