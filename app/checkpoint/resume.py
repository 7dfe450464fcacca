"""Resume: find the checkpoint to continue from, check it against its manifest and the run, convert it for
another world size, and restore everything it holds."""
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from app.distributed import dist
from app.ds import internals as ds_internals, precision
from app.checkpoint import outdir
from app.data import sources
from app.ds.internals.safe_load import check_files, data_only
from app.checkpoint.save import MANIFEST, RANK_FILES, STATE, UNIVERSAL, TrainerState, checkpoint_root, same_base, \
    complete_checkpoints, atomic_write, has_frozen, set_rng_state, sha256_of
from app.errors import UserError, first_line


def checkpoint_folder(path) -> Path:
    """The checkpoint a path names: a checkpoint folder itself, or the newest complete checkpoint of a run folder
    (or of its checkpoints folder), which users have at hand more often."""
    path = Path(path)
    for root in (path / "checkpoints", path):
        if root.is_dir() and not (root / MANIFEST).exists() and any(root.glob("step*")):
            done = complete_checkpoints(root)
            if not done:
                raise UserError(f"{path} holds no complete checkpoint (every save in {root} was cut short); "
                                f"start a new run")
            return done[-1]
    return path


def verify(folder: Path) -> TrainerState:
    """The checkpoint's saved state, after checking every file against the manifest."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise UserError(f"{folder} is not a complete checkpoint (no {MANIFEST}); pass a run folder, a checkpoint "
                        f"folder such as <output_dir>/checkpoints/step00000100, or --resume auto")
    manifest = _read_json(folder, MANIFEST)
    for name, expected in manifest.items():
        path = folder / name
        if not path.is_file():
            raise UserError(f"checkpoint {folder} is damaged: {name} is missing; {_instead(folder)}")
        if path.stat().st_size != expected["size"] or sha256_of(path) != expected["sha256"]:
            raise UserError(f"checkpoint {folder} is damaged: {name} does not match its manifest; {_instead(folder)}")
    state = TrainerState.from_json(json.dumps(_read_json(folder, STATE)), folder / STATE)
    check_files(folder)  # whoever can write the files can write the manifest: it vouches for whole, not harmless
    return state


def _read_json(folder: Path, name: str):
    """A JSON file of the checkpoint, or one line when it is cut short or not JSON."""
    try:
        found = json.loads((folder / name).read_bytes().decode("utf-8"))
        if not isinstance(found, dict):
            raise ValueError(f"a JSON {type(found).__name__}, not an object")
        return found
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"checkpoint {folder} is damaged: {name} cannot be read ({first_line(e)}); "
                        f"{_instead(folder)}") from None


def _instead(folder: Path) -> str:
    """What to resume from instead of a damaged checkpoint."""
    older = [p for p in complete_checkpoints(folder.parent) if p.name < folder.name]
    return (f"resume from the one before it, deleting the later ones: --resume {shlex.quote(str(older[-1]))} "
            f"--overwrite") if older else "start a new --output_dir"


def named_checkpoint(resume: str) -> Path:
    """The checkpoint folder --resume names (not auto), or one line when there is none."""
    folder = checkpoint_folder(resume)
    if not folder.is_dir():
        raise UserError(f"--resume {resume}: no such folder; pass a run folder, a checkpoint folder under "
                        f"<output_dir>/checkpoints, or --resume auto")
    return folder


def run_folder_of(resume: str) -> Path:
    """Where a run resumed from a named checkpoint without --output_dir continues: that checkpoint's own run
    folder (<run>/checkpoints/step<N>, beside the run's metrics.csv), else one line asking for --output_dir."""
    folder = named_checkpoint(resume).resolve()
    run = folder.parent.parent
    if folder.parent.name != "checkpoints" or not (run / "metrics.csv").is_file():
        raise UserError(f"--resume {resume}: {folder} is not inside the run folder that made it, so where this run "
                        f"should write is not known; pass --output_dir for it")
    return run


def find(output_dir: Path, resume: str):
    """(folder, saved state) to resume from after checking every file, or (None, None) to start fresh."""
    if not resume:
        return None, None
    if resume == "auto":
        folder = (complete_checkpoints(checkpoint_root(output_dir)) or [None])[-1]
        if folder is None:
            return None, None
    else:
        folder = named_checkpoint(resume)
        if folder != Path(resume):
            dist.print0(f"resume: the newest complete checkpoint of {resume} is {folder.name}")
    return folder, verify(folder)


def check_compatible(saved: TrainerState, current: TrainerState, folder: Path):
    """Refuse a checkpoint of another model, dataset, row order, ZeRO stage, pipeline split, precision, LoRA or task."""
    for key in ("model", "dataset", "zero_stage", "pipeline_stages", "tensor_parallel_size"):
        if getattr(saved, key) != getattr(current, key):
            raise UserError(f"checkpoint {folder} was made with {key}={getattr(saved, key)!r} but this run has "
                            f"{key}={getattr(current, key)!r}; use the same settings or start a new --output_dir")
    orders = [sources.row_order(state.settings) for state in (saved, current)]
    for key in (key for key in orders[0] if orders[0][key] != orders[1][key]):  # other rows under the resumed run
        then, now = (state.settings.get(key, order[key]) for state, order in zip((saved, current), orders))
        raise UserError(f"checkpoint {folder} was made with --{key} {then!r} but this run has {now!r}, which "
                        f"trains on other rows; pass the same or start a new --output_dir")
    weights = [precision.weights_of(state.deepspeed_config) for state in (saved, current)]
    if weights[0] != weights[1]:
        raise UserError(f"checkpoint {folder} was trained with {weights[0]} weights and this run has {weights[1]} "
                        f"ones (precision \"auto\" weighs this GPU's memory); set the JSON's precision sections to "
                        f"what that run had (its trainer_state.json holds its DeepSpeed dict), or start a new "
                        f"--output_dir")
    then, now = ({k: v.replace(" ", "") if k == "targets" else v for k, v in state.lora.items() if k != "base"}
                 for state in (saved, current))  # a record of before: the targets as typed
    if then != now:
        said = lambda lora: f"LoRA {lora}" if lora else "no LoRA"  # noqa: E731
        raise UserError(f"checkpoint {folder} was made with {said(then)} but this run has {said(now)}; pass the "
                        f"same --lora flags or start a new --output_dir")
    _check_task_record(saved, current, folder)
    _check_windows(saved, current, folder)
    if saved.lora and not same_base(saved.lora.get("base", ""), current.lora.get("base", "")):
        raise UserError(f"checkpoint {folder} holds LoRA adapters trained on another base model than {current.model} "
                        f"has now (its config or weights differ); resume on the base model they were trained on, "
                        f"or start a new --output_dir")


# The flag that sets each field of a task's record where it is not --<field> (the reference one also follows --lora).
FLAGS = {"loss": "--preference_loss", "gamma": "--simpo_gamma"}
# What the lines call each kind of training that records its settings (a record without "task": preference's).
KINDS = {"preference": ("preference", "preference tuning"), "grpo": ("GRPO", "GRPO")}


def _check_task_record(saved: TrainerState, current: TrainerState, folder: Path):
    """Refuse a resume with other settings of the task's loss (preference tuning's loss, beta, SimPO's gamma or
    reference; GRPO's loss, sampling and rewards), another kind of training, or a reference on another base."""
    then, now = saved.task_record, current.task_record
    kinds = [KINDS[record.get("task", "preference")] if record else None for record in (then, now)]
    if kinds[0] != kinds[1]:
        named = next(kind for kind in kinds if kind)[1]
        said = [kind[1] if kind else f"no {named}" for kind in kinds]
        raise UserError(f"checkpoint {folder} was made with {said[0]} but this run has {said[1]}; pass the "
                        f"same --task or start a new --output_dir")
    simpo = "simpo" in (then.get("loss"), now.get("loss"))  # gamma counts only where SimPO's loss reads it
    keys = [key for key in {**then, **now} if key != "base" and (key != "gamma" or simpo)]
    changed = [key for key in keys if then.get(key) != now.get(key)]
    if changed:
        said = ", ".join(f"{key} {then.get(key)!r} -> {now.get(key)!r}" for key in changed)
        flags = ", ".join(FLAGS.get(key, f"--{key}") for key in changed)
        raise UserError(f"checkpoint {folder} was made with other {kinds[0][0]} settings than this run has ({said}), "
                        f"which would change the loss mid-run; pass the same {flags} as that run or start a new "
                        f"--output_dir")
    if not same_base(then.get("base") or "", now.get("base") or "") and \
            then.get("reference") not in (None, "", "none (SimPO)"):
        raise UserError(f"checkpoint {folder} trained against a reference of another base model than {current.model} "
                        f"has now (its config or weights differ, or its seed); resume on the base model it started "
                        f"from, or start a new --output_dir")


def _check_windows(saved: TrainerState, current: TrainerState, folder: Path):
    """A run that trains each window of samples several times (GRPO's --num_iterations) resumes only on the same
    windows (micro batch over the data-parallel ranks, accumulation): the loader's repeats keep the saved cycles."""
    if saved.task_record.get("num_iterations", 1) == 1:
        return
    micro, steps = "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
    then, now = ((s.deepspeed_config[micro] * (s.data_parallel_size or s.world_size), s.deepspeed_config[steps])
                 for s in (saved, current))
    if then != now:
        raise UserError(f"checkpoint {folder} trains each window of prompts {saved.task_record['num_iterations']} "
                        f"times (--num_iterations) over windows of {then[1]} global micro batch(es) of {then[0]}; "
                        f"this run has {now[1]} of {now[0]}: resume with {micro} x data-parallel ranks = {then[0]} "
                        f"and {steps} = {then[1]}")


def needs_universal(saved: TrainerState, world_size: int) -> bool:
    """ZeRO partitions optimizer state by world size: another world size needs a universal checkpoint."""
    return saved.zero_stage > 0 and saved.world_size != world_size


def _optimizer_place(state: TrainerState) -> str:
    """Where a run keeps its ZeRO-3 optimizer state: "nvme", "cpu" or "the device" (below ZeRO-3, "the device")."""
    zero = state.deepspeed_config.get("zero_optimization") or {}
    device = str((zero.get("offload_optimizer") or {}).get("device") or "none") if state.zero_stage == 3 else "none"
    return "the device" if device == "none" else device


def _check_nvme(saved: TrainerState, current: TrainerState, folder: Path):
    """DeepSpeed loads a ZeRO-3 optimizer state on NVMe only from the swap files of the same ranks (offloaded_tensors
    /), and converts none to another world size: refuse any other way in or out of NVMe."""
    places = [_optimizer_place(state) for state in (saved, current)]
    if "nvme" in places and (places[0] != places[1] or saved.world_size != current.world_size):
        raise UserError(f"checkpoint {folder} was saved by {saved.world_size} rank(s) with the optimizer state on "
                        f"{places[0]}, and this run has {current.world_size} with it on {places[1]}: DeepSpeed loads "
                        f"a state offloaded to NVMe only as it was saved; resume with the ranks and "
                        f"offload_optimizer.device it had, or start a new --output_dir")


def checkpoint_to_resume(output_dir: Path, resume: str, current: TrainerState, overwrite=False) -> tuple:
    """(folder, saved state, whether it is a universal checkpoint) to resume from, or (None, None, False) to start
    fresh; checked against this run and its output folder's timeline before anything is built."""
    folder, saved = find(output_dir, resume)
    if folder is None:
        if resume:
            dist.print0(f"resume: no complete checkpoint in {checkpoint_root(output_dir)}, starting fresh")
        return None, None, False
    check_compatible(saved, current, folder)
    mixed = dist.broadcast_object(outdir.check_timeline(output_dir, folder, overwrite) if dist.is_main() else "")
    if mixed:
        raise UserError(mixed)
    if (current.pipeline_stages or current.tensor_parallel_size > 1) and saved.world_size != current.world_size:
        kind = "pipeline" if current.pipeline_stages else "tensor-parallel"
        raise UserError(f"checkpoint {folder} is a {kind} run of {saved.world_size} rank(s) and the app cannot "
                        f"reshape its per-stage or per-shard state; resume it with {saved.world_size} rank(s)")
    _check_nvme(saved, current, folder)
    if needs_universal(saved, current.world_size):
        dist.print0(f"resume: {folder} was saved by {saved.world_size} rank(s), this run has "
                    f"{current.world_size}: converting it to a universal checkpoint")
        return make_universal(folder, saved), saved, True
    return folder, saved, False


def make_universal(folder: Path, saved: TrainerState) -> Path:
    """Convert a ZeRO checkpoint with DeepSpeed's ds_to_universal (once, on the main rank); return its folder."""
    target = folder.parent / UNIVERSAL / folder.name
    problem = ""
    if dist.is_main() and not (target / MANIFEST).is_file():
        shutil.rmtree(target, ignore_errors=True)
        command = [sys.executable, "-m", "app.ds.internals.universal", "--input_folder", str(folder.resolve()),
                   "--output_folder", str(target.resolve()), "--inject_missing_state", "--num_extract_workers", "1",
                   "--num_merge_workers", "1"]
        done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
        if done.returncode == 0:
            for name in (STATE, *(p.name for p in folder.glob(RANK_FILES))):  # the rng's and the task's
                shutil.copy(folder / name, target / name)
            atomic_write(target / MANIFEST, "{}")  # marks the conversion as finished
        else:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("error: ")
            problem = (f"DeepSpeed cannot convert {folder} to another world size ({last}); "
                       f"resume it with {saved.world_size} rank(s)")
    problem = dist.broadcast_object(problem)
    if problem:
        raise UserError(problem)
    return target


def load(engine, task, folder: Path, saved: TrainerState, replicas: int) -> tuple:
    """Restore engine, optimizer, scheduler, RNG and the task's own files (app/core/task.py: load_rank_files);
    return the (epoch, micro batch) this run continues from."""
    with data_only(f"a file under {folder}"):
        path, _ = engine.load_checkpoint(str(folder.parent), tag=folder.name, load_optimizer_states=True,
                                         load_lr_scheduler_states=True, load_module_strict=not has_frozen(engine))
        if path is not None:
            ds_internals.restore_swapped_adam(engine, folder)
    if path is None:
        raise UserError(f"DeepSpeed could not load {folder}; it may come from another world size or config")
    ds_internals.replay_cpu_adam_steps(engine)
    rng_file = folder / f"rng_rank{dist.rank():05d}.json"
    if rng_file.is_file():  # absent for ranks that did not exist when it was saved: they keep the seed
        set_rng_state(json.loads(rng_file.read_text()))
    task.load_rank_files(engine, folder)
    samples, span = saved.samples_into_epoch(), engine.train_micro_batch_size_per_gpu() * replicas
    if samples % span:
        dist.print0(f"resume: {samples} samples into the epoch is not a whole number of global micro "
                    f"batches of {span}; repeating the last {samples % span}")
    dist.print0(f"resume: {folder} at step {saved.step}, epoch {saved.epoch}, batch {saved.batch}")
    return saved.epoch, samples // span


def output_dir_for(settings) -> Path:
    """The run's output directory (the flag, the resumed checkpoint's own run folder, or a fresh timestamped one
    chosen by rank 0), checked and locked for this run by rank 0."""
    if settings.resume == "auto" and not settings.output_dir:
        raise UserError("--resume auto continues the run in --output_dir; pass the same --output_dir as that run")
    if settings.resume and settings.resume != "auto" and not settings.output_dir:
        settings.output_dir = str(run_folder_of(settings.resume))
    path = Path(dist.broadcast_object(settings.output_dir or outdir.default_name(settings.dataset, settings.model)))
    problem, note = "", ""
    if dist.is_main():
        problem = outdir.check(path, settings.overwrite, bool(settings.resume))
        problem, note = (problem, "") if problem else outdir.lock(path)
    problem = dist.broadcast_object(problem)
    if problem:
        raise UserError(problem)
    if note:
        dist.print0(note)
    return path
