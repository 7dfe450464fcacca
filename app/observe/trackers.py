"""Trackers besides TensorBoard (docs/watching.md, "Trackers"): W&B, Comet and CSV files through DeepSpeed's own
monitor, which the DeepSpeed dict turns on and the engine starts on rank 0; MLflow, which DeepSpeed lacks, through
the app's own writer. Every metrics.csv row goes to each tracker; only the main rank reports."""
import importlib
import os
import sys
from dataclasses import asdict

from app.distributed import dist
from app.errors import UserError, first_line
from app.redact import redacted, without_password

TRACKERS = ("wandb", "comet", "mlflow")
"""What --report_to names; "none" and "tensorboard" (always written) are taken too, and add nothing."""
ADDED = {"wandb": {}, "comet": {"samples_log_interval": 1}}
"""A section --report_to adds where the JSON has none: Comet logs every row (DeepSpeed's default thins each name to
one value per 100 samples)."""
PACKAGES = {"wandb": ("wandb", "-r requirements-trackers.txt"), "comet": ("comet_ml", '"comet_ml>=3.41.0"'),
            "mlflow": ("mlflow", "-r requirements-trackers.txt")}
"""Each tracker's module, and what to pip install when it is missing."""
COMET_OLDEST = "3.41.0"
"""The oldest comet_ml DeepSpeed's Comet monitor takes."""


def asked(report_to: str) -> tuple:
    """The trackers --report_to names (comma-separated); an unknown name is one line."""
    names = tuple(dict.fromkeys(name.strip().lower() for name in report_to.split(",") if name.strip()))
    unknown = [name for name in names if name not in (*TRACKERS, "none", "tensorboard")]
    if unknown:
        raise UserError(f"--report_to: unknown tracker {unknown[0]!r}; name any of {', '.join(TRACKERS)}, "
                        f"comma-separated")
    return tuple(name for name in names if name in TRACKERS)


def on(ds: dict, section: str) -> bool:
    """Whether the DeepSpeed dict turns a monitor section on."""
    return bool((ds.get(section) or {}).get("enabled"))


def enabled(ds: dict, report_to: str) -> dict:
    """The run's DeepSpeed dict with the monitors --report_to asks for turned on where the JSON leaves them off (W&B's
    project from WANDB_PROJECT where the section names none) and Comet's api_key handed over in COMET_API_KEY instead,
    so that no dict the run saves or prints holds it. A tracker that cannot start here (a package missing, an
    unusable MLflow store) is one line, before anything is written; rank 0, the one that reports, decides."""
    names = asked(report_to)
    ds = with_sections(ds, names)
    if (ds.get("comet") or {}).get("api_key"):
        os.environ["COMET_API_KEY"] = ds["comet"]["api_key"]  # read by comet_ml when the section names no key
        ds["comet"] = {key: value for key, value in ds["comet"].items() if key != "api_key"}
    problem = dist.broadcast_object(cannot_start(ds, names) if dist.is_main() else "")
    if problem:
        raise UserError(problem)
    return ds


def with_sections(ds: dict, names: tuple) -> dict:
    """ds with the DeepSpeed monitors that names ask for turned on, keeping what the JSON's sections set (ADDED
    where it has none); a W&B section without a project takes WANDB_PROJECT where it is set (DeepSpeed would name
    its own default, "deepspeed")."""
    ds = dict(ds)
    for name in ("wandb", "comet"):
        if name in names and not on(ds, name):
            ds[name] = {**ADDED[name], **(ds.get(name) or {}), "enabled": True}
    if on(ds, "wandb") and "project" not in ds["wandb"] and os.environ.get("WANDB_PROJECT"):
        ds["wandb"] = {**ds["wandb"], "project": os.environ["WANDB_PROJECT"]}
    return ds


def cannot_start(ds: dict, names: tuple) -> str:
    """Why a tracker of the run cannot start on this machine ('' when all can): its package does not import, W&B
    online finds no login, or MLflow cannot open its store."""
    wanted = [(name, f"--report_to {name}" if name in names else f"the DeepSpeed config's \"{name}\" section")
              for name in ("wandb", "comet") if on(ds, name)]
    wanted += [("mlflow", "--report_to mlflow")] if "mlflow" in names else []
    for name, why in wanted:
        module, pip = PACKAGES[name]
        try:
            imported = importlib.import_module(module)
        except ImportError as e:
            return f"{why} needs the {module} package, which does not import ({first_line(e)}): pip install {pip}"
        if name == "comet" and _older(imported.__version__, COMET_OLDEST):
            return f"{why} needs comet_ml {COMET_OLDEST} or later, not {imported.__version__}: pip install {pip}"
        if name == "wandb" and (problem := _wandb_login_problem(imported)):
            return f"{why}: {problem}"
    return _mlflow_store_problem() if "mlflow" in names else ""


def _wandb_login_problem(wandb) -> str:
    """Why W&B cannot start here ('' where it can): online (WANDB_MODE) without a key of its own (WANDB_API_KEY, the
    .netrc `wandb login` writes, its settings), found as wandb.init would find it, without asking or calling out.
    wandb.init would otherwise end rank 0 inside DeepSpeed's engine while the others wait for it."""
    if os.environ.get("WANDB_MODE", "").strip().lower() in ("offline", "dryrun", "disabled"):
        return ""
    from app.ds import internals as ds_internals
    try:
        if ds_internals.wandb_key_found(wandb):
            return ""
    except TypeError:  # a W&B older than its quiet search: wandb.init says for itself
        return ""
    except Exception as e:  # noqa: BLE001 (W&B's own refusal of the key it found, in one line)
        return f"W&B refuses its login here ({first_line(e)}); run `wandb login` again or fix WANDB_API_KEY"
    return ("W&B runs online (WANDB_MODE) and finds no login on this machine; run `wandb login`, set "
            "WANDB_API_KEY, or set WANDB_MODE=offline (then `wandb sync`) or disabled")


def _older(version: str, oldest: str) -> bool:
    from packaging.version import Version
    return Version(version) < Version(oldest)


def _mlflow_store_problem() -> str:
    """Why MLflow cannot use the store MLFLOW_TRACKING_URI (or its default) names, or ''."""
    import mlflow
    try:
        mlflow.MlflowClient().search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001 (any failure to open the store is the same line: which store, and why)
        return (f"--report_to mlflow: MLflow cannot use its store {without_password(mlflow.get_tracking_uri())} "
                f"({without_password(first_line(e))}); "
                f"set MLFLOW_TRACKING_URI to a tracking server or to sqlite:///<file>")
    return ""


class Trackers:
    """The trackers a run reports to: on the main rank, DeepSpeed's monitors of its engine and an MLflow run; none
    on the others."""

    def __init__(self, monitor=None, samples=None, params: dict = None, name: str = ""):
        """monitor: the engine's DeepSpeed monitor (engine.monitor), whose W&B, Comet and CSV monitors take each row
        at samples() samples, the count DeepSpeed's own events use (its TensorBoard monitor does not: the app writes
        TensorBoard itself); params: start an MLflow run named name with these params, secrets hidden (None: no
        MLflow)."""
        self.monitors = [m for m in (monitor.wandb_monitor, monitor.comet_monitor, monitor.csv_monitor)
                         if m is not None] if monitor is not None else []
        self.wandb = monitor is not None and monitor.wandb_monitor is not None
        self.comet = monitor.comet_monitor if monitor is not None else None
        self.samples, self.plotted = samples, set()
        self.mlflow = None
        if params is not None:
            import mlflow
            mlflow.start_run(run_name=name or None)
            mlflow.log_params(redacted(params))
            self.mlflow = mlflow

    def write(self, row: dict):
        """One metrics.csv row: each value under its column's name, "step" the optimizer step."""
        values = {key: value for key, value in row.items() if value is not None}
        if self.monitors:
            # W&B keeps a step only while it grows, and DeepSpeed's events count samples: the rows count them too
            at = self.samples()
            for monitor in self.monitors:
                monitor.write_events([(key, value, at) for key, value in values.items()])
            if self.wandb:
                self._plot_against_step(values)
        if self.mlflow is not None:
            self.mlflow.log_metrics({key: float(value) for key, value in values.items() if key != "step"},
                                    step=int(row["step"]), synchronous=False)  # a slow server never holds a step

    def _plot_against_step(self, values: dict):
        """W&B draws each of the app's names against the optimizer step (DeepSpeed's own, against samples)."""
        import wandb
        for key in values.keys() - self.plotted - {"step"}:
            wandb.define_metric(key, step_metric="step")
        self.plotted |= values.keys()

    def close(self, failed: bool = False):
        """End every tracker's run, as failed or as finished; a second call does nothing."""
        if self.wandb:
            import wandb
            wandb.finish(exit_code=1 if failed else 0)
        if self.comet is not None and self.comet.experiment is not None:
            self.comet.experiment.end()
        if self.mlflow is not None:
            self.mlflow.end_run("FAILED" if failed else "FINISHED")
        self.monitors, self.wandb, self.comet, self.mlflow = [], False, None, None


def for_run(engine, settings, name: str) -> Trackers:
    """The run's trackers: on the main rank, the monitors the engine's dict turns on and, with --report_to mlflow,
    an MLflow run named name whose params are the run's settings; none on the other ranks."""
    if not dist.is_main():
        return Trackers()
    params = asdict(settings) if "mlflow" in asked(settings.report_to) else None
    return Trackers(engine.monitor, lambda: engine.global_samples, params, name)


def finish_open(failed: bool):
    """End the W&B run DeepSpeed's monitor started at the engine's build when no run log took it over (a run with
    nothing left to do, one that ended before training), as failed or finished; else nothing."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=1 if failed else 0)
