"""Everything the main rank writes for a run: the progress bar or log lines, metrics.csv, TensorBoard, the trackers
(app/observe/trackers.py), summary.json and the loss plot. Whether an output folder may take a run:
app/checkpoint/outdir.py."""
import contextlib
import csv
import io
import json
import sys
from pathlib import Path

from app.distributed import dist
from app.checkpoint.save import atomic_write
from app.data.samples import declared
from app.observe.metrics import Throughput
from app.observe.trackers import Trackers

CSV_FIELDS = ["step", "epoch", "loss", "lr", "skipped_steps", "samples_per_s", "tokens_per_s", "mfu", "eval_loss",
              "eval_accuracy", "eval_perplexity"]
SHOWN = ("loss", "lr", "skipped_steps", "samples_per_s", "tokens_per_s", "mfu", "eval_loss", "eval_accuracy",
         "eval_perplexity")


def columns(task, train_set, held_set) -> tuple:
    """metrics.csv's columns: the task's own, and with several sources each one's evaluation (eval_loss/<name>, ...)
    and the rows and tokens it gave to training (rows/<name>, tokens/<name>)."""
    own = tuple(task.log_columns)
    held, train = declared(held_set).sources, declared(train_set).sources
    evals = [c for c in (*CSV_FIELDS, *own) if c.startswith("eval_")]
    each_held = tuple(f"{c}/{n}" for n in held.names for c in evals) if held is not None else ()
    each_trained = tuple(f"{what}/{n}" for what in ("rows", "tokens") for n in train.names) if train is not None else ()
    return own + each_held + each_trained


class RunLog:
    """Everything the main rank writes; on other ranks (and with no output_dir) it writes nothing."""

    def __init__(self, output_dir, total_steps: int, resumed_step: int = 0, show_progress=None,
                 throughput: "Throughput" = None, columns: tuple = (), trackers: Trackers = None):
        """Start metrics afresh, or (resumed_step > 0) keep the rows up to that step and append. show_progress:
        True draws the bar, False prints plain lines, None (default) draws it only on a terminal. columns: the
        task's own, after the others (preference tuning's rewards, and their eval_ ones). trackers: where each row
        goes besides (trackers.for_run), closed by finish, or as failed by an error in discarded_on_error."""
        self.active = dist.is_main() and output_dir is not None
        self.fields = CSV_FIELDS + list(columns)
        self.shown = SHOWN + tuple(c for c in columns if ("accuracy" in c or c in ("reward", "eval_reward"))
                                   and "/" not in c)  # not each source's; online RL's mean reward
        self.output_dir, self.resumed = output_dir, bool(resumed_step)
        self.throughput = throughput or Throughput()
        self.trackers = trackers or Trackers()
        self.rows = []
        if not self.active:
            return
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm
        output_dir.mkdir(parents=True, exist_ok=True)
        if resumed_step:  # rows logged after the checkpoint are redone by this run
            self.rows = [r for r in read_rows(output_dir / "metrics.csv") if r["step"] <= resumed_step]
        else:
            for stale in (output_dir / "tensorboard").glob("events.out.tfevents.*"):  # an overwritten run's
                stale.unlink()
        kept = io.StringIO()
        writer = csv.DictWriter(kept, fieldnames=self.fields)
        writer.writeheader()
        writer.writerows({k: _fmt(row.get(k)) for k in self.fields} for row in self.rows)
        atomic_write(output_dir / "metrics.csv", kept.getvalue())  # a crash now leaves the old rows, not none
        self.csv_file = open(output_dir / "metrics.csv", "a", newline="")
        self.csv = csv.DictWriter(self.csv_file, fieldnames=self.fields)
        self.tb = SummaryWriter(str(output_dir / "tensorboard"), purge_step=resumed_step + 1 if resumed_step else None)
        # disable=None: a bar on a terminal, plain log lines when output goes to a file or pipe
        self.bar = tqdm(total=total_steps, initial=resumed_step, unit="step", dynamic_ncols=True,
                        disable=None if show_progress is None else not show_progress, file=sys.stdout)
        self.plain = self.bar.disable

    def write_row(self, row: dict):
        """One metrics.csv row; also TensorBoard scalars, the trackers, and the progress bar or a log line."""
        if not self.active:
            return
        self.rows.append(row)
        self.csv.writerow({k: _fmt(row.get(k)) for k in self.fields})
        self.csv_file.flush()
        for key, value in row.items():
            if key not in ("step", "epoch") and value is not None:
                self.tb.add_scalar(key, value, row["step"])
        self.trackers.write(row)
        shown = {k: f"{row[k]:.4g}" for k in self.shown if row.get(k) is not None and (k != "skipped_steps" or row[k])}
        if self.plain:
            print(f"step {row['step']} epoch {row['epoch']} " + " ".join(f"{k} {v}" for k, v in shown.items()),
                  flush=True)
        else:
            self.bar.set_postfix(shown, refresh=False)

    def rates(self, samples: float, seconds: float) -> dict:
        """samples_per_s, and tokens_per_s and mfu where the task has tokens."""
        return self.throughput.rates(samples, seconds)

    def train_row(self, step: int, epoch: int, loss: float, lr: float, samples: float, seconds: float,
                  skipped_steps: int = 0, extra: dict = None):
        """The row of a log interval: its mean loss, learning rate, the run's skipped steps so far, throughput, and
        the task's own means (extra)."""
        self.write_row({"step": step, "epoch": epoch, "loss": loss, "lr": lr, "skipped_steps": skipped_steps,
                        **(extra or {}), **self.rates(samples, seconds)})

    def advance(self, steps: int):
        """Move the progress bar on by steps optimizer steps."""
        if self.active and steps:
            self.bar.update(steps)

    def message(self, text: str):
        """A line for the user that does not break the progress bar."""
        if self.active:
            self.bar.write(text, file=sys.stdout) if not self.plain else print(text, flush=True)

    @contextlib.contextmanager
    def discarded_on_error(self, has_checkpoint):
        """Around the training of a fresh run: if it ends on an error (damaged data, a full disk, out of memory)
        before any checkpoint exists, its files go, so the same command can run again once the cause is fixed. The
        trackers' runs end as failed on any error."""
        try:
            yield
        except Exception:
            if self.active:
                with contextlib.suppress(Exception):  # the run's own error is the one to say
                    self.trackers.close(failed=True)
            if self.active and not self.resumed and not has_checkpoint():
                self.bar.close()
                self.tb.close()
                self.csv_file.close()
                for path in [self.output_dir / "metrics.csv", *(self.output_dir / "tensorboard").glob("events.*")]:
                    path.unlink(missing_ok=True)
            raise

    def finish(self, summary: dict):
        """Write summary.json and loss.png, close every file and end the trackers' runs."""
        if not self.active:
            return
        self.bar.close()
        self.tb.close()
        self.csv_file.close()
        (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_losses(self.rows, self.output_dir / "loss.png")
        self.trackers.close()


def read_rows(path: Path) -> list:
    """metrics.csv rows with numbers parsed and empty cells as None ([] when there is no file)."""
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [{k: (None if v == "" else int(v) if k in ("step", "epoch", "skipped_steps") else float(v))
                 for k, v in row.items()} for row in csv.DictReader(f)]


def _fmt(value):
    if value is None:
        return ""
    return f"{value:.8g}" if isinstance(value, float) else value


def plot_losses(rows, path: Path):
    """Training and evaluation loss against step, saved as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if all(value > 0 for _, value in train + evals):  # an RL loss can be 0 or below
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
