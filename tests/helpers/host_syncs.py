"""Count the host synchronisations of training steps: every place the host waits for the device, the app's and
DeepSpeed's alike, found on a CPU.

On a GPU the host queues work and runs ahead; a read of a device value (`.item()`, `.tolist()`, `bool()`,
`float()` or `int()` of a tensor, `.cpu()`, `.numpy()`, an op whose output size depends on the data such as
`nonzero` or a boolean mask, `masked_fill` with a tensor as its value) or a device synchronize makes it wait until
the device has caught up. A
TorchFunctionMode sees each of those calls on any device, CPU included, so a CPU run counts what a GPU run
would wait on. It also counts a tensor made on the device from Python values (`torch.tensor(-1.0,
device=...)`: on a GPU a blocking copy from the host), and the stream and device synchronizations DeepSpeed
makes on CUDA alone: each sits behind `if not get_accelerator().resolves_data_dependency():`, which a CPU run
asks too, so the guard's next line says what a GPU would wait on. `torch.cuda.set_sync_debug_mode("error")` in
the GPU run of this harness checks the same on the device. Reads inside app/distributed/dist.py are not counted: it reads
only the host group's CPU tensors, which it builds from Python numbers.

Steps are told apart by the inner torch optimizer's step (a global post-step hook), so the count needs no hook
in the app: window k runs from the end of optimizer step k to the end of step k+1 and holds one whole step
(the loop's stop vote after step k, the micro steps and the optimizer step of k+1). Runs log, evaluate and
save only at their last step, so windows first..last-1 are plain training steps.

As a launch script, it runs several train.py jobs in one process group, like tests/helpers/jobs.py, each under the
counter with precision "auto" resolved as on a GPU with bf16, and writes <report>/<i>.json per job (rank 0:
the largest count of any rank per window, with its sources):

    deepspeed --num_gpus 2 tests/helpers/host_syncs.py <jobs.json> <report folder> [--cuda_errors]
"""
import collections
import contextlib
import importlib
import io
import json
import linecache
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

REPO_PATH = Path(__file__).resolve().parents[2]
READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "__array__",
         "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "repeat_interleave"}
REPO = str(REPO_PATH) + "/"


TORCH_DIR = str(Path(torch.__file__).parent) + "/"


def _source() -> str:
    """'file:line function' of the innermost frame outside torch: the code that asked for the value. (torch's own
    folder, not any path with /torch/ in it: on a GPU machine the whole environment lived under /opt/torch/.)"""
    for frame in reversed(traceback.extract_stack()):
        if not (frame.filename.startswith(TORCH_DIR) or frame.filename.endswith("/host_syncs.py")):
            name = frame.filename.split("site-packages/")[-1].replace(REPO, "")
            return f"{name}:{frame.lineno} {frame.name}"
    return "?"


def _frame_source(frame) -> str:
    name = frame.f_code.co_filename.split("site-packages/")[-1].replace(REPO, "")
    return f"{name}:{frame.f_lineno} {frame.f_code.co_name}"


def _device_type(value) -> str:
    return torch.device(value).type if isinstance(value, (str, torch.device)) else \
        "cuda" if isinstance(value, int) else ""


def _copies_python_values_to(device: torch.device, name: str, args, kwargs) -> bool:
    """True for a tensor made on the device from Python values (`torch.tensor(-1.0, device=...)`): on a GPU, a
    copy the host waits for. (A CPU tensor's `.to(device)` is not counted: on a CPU run it cannot be told from a
    tensor already on the device.)"""
    if name in ("tensor", "as_tensor"):
        data = args[0] if args else kwargs.get("data")
        return not isinstance(data, torch.Tensor) and _device_type(kwargs.get("device")) == device.type
    return False


def _fills_with_a_tensor(name: str, args, kwargs) -> bool:
    """masked_fill with a tensor as the value: CUDA's kernel takes a number, so it reads the tensor on the host (seen
    on an H100: DeepSpeed's mask of a norm that is not finite, under torch.cuda.set_sync_debug_mode("error"))."""
    value = args[2] if len(args) > 2 else kwargs.get("value")
    return name in ("masked_fill", "masked_fill_") and isinstance(value, torch.Tensor)


def _boolean_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class HostSyncs(TorchFunctionMode):
    """Counts host synchronisations per optimizer-step window while active (a context manager)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.steps = device, 0
        self.windows = collections.defaultdict(collections.Counter)
        self.hooks = []

    def __enter__(self):
        from deepspeed.accelerator import get_accelerator
        optimizer_hooks = importlib.import_module("torch.optim.optimizer")
        self.hooks.append(optimizer_hooks.register_optimizer_step_post_hook(self._stepped))
        accelerator = get_accelerator()
        real = accelerator.synchronize
        accelerator.synchronize = lambda *a, **k: (self._count("synchronize"), real(*a, **k))[1]
        self.hooks.append(_Restore(accelerator, "synchronize", real))
        resolves = accelerator.resolves_data_dependency
        accelerator.resolves_data_dependency = lambda: (self._cuda_only_wait(), resolves())[1]
        self.hooks.append(_Restore(accelerator, "resolves_data_dependency", resolves))
        return super().__enter__()

    def _cuda_only_wait(self):
        """Count a wait DeepSpeed makes on CUDA alone: `if not get_accelerator().resolves_data_dependency():`
        guards each stream or device synchronize that a CPU run skips; the guarded line says which it is."""
        frame = sys._getframe(1)
        while frame.f_code.co_filename.endswith("/tests/helpers/host_syncs.py"):
            frame = frame.f_back
        guarded = linecache.getline(frame.f_code.co_filename, frame.f_lineno + 1)
        # on a GPU the guarded line runs, and a device synchronize there is counted by the call itself
        if "synchronize()" in guarded and (self.device.type == "cpu" or "accelerator().synchronize()" not in guarded):
            self._count("synchronize (on CUDA)", frame)

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*exc)

    def _stepped(self, optimizer, args, kwargs):
        self.steps += 1

    def _count(self, kind: str, frame=None):
        source = _source() if frame is None else _frame_source(frame)
        if not source.startswith("app/distributed/dist.py"):  # the host group's own CPU tensors
            self.windows[self.steps][f"{kind} at {source}"] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS or (name == "__getitem__" and _boolean_index(args)) or \
                (name == "where" and len(args) == 1 and not kwargs) or _fills_with_a_tensor(name, args, kwargs or {}):
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
            # on a GPU a CPU tensor's value is already on the host
            if tensor is None or self.device.type == "cpu" or tensor.device.type != "cpu":
                self._count(name)
        elif _copies_python_values_to(self.device, name, args, kwargs or {}):
            self._count(f"copy to the device ({name})")
        return func(*args, **(kwargs or {}))

    def per_step(self, optimizer_steps: int, first: int) -> dict:
        """{window: Counter} for the plain training windows first..optimizer_steps-1 (inner optimizer steps
        taken before the run's first step, by an optimizer's own set-up, are left out)."""
        offset = self.steps - optimizer_steps
        return {k - offset: self.windows.get(k, collections.Counter())
                for k in range(first + offset, optimizer_steps + offset)}


class _Restore:
    def __init__(self, owner, name, value):
        self.owner, self.name, self.value = owner, name, value

    def remove(self):
        setattr(self.owner, self.name, self.value)


@contextlib.contextmanager
def cuda_errors_between(counter: HostSyncs, first: int, last: int):
    """On CUDA, make every synchronising CUDA call raise during optimizer-step windows first..last-1."""
    optimizer_hooks = importlib.import_module("torch.optim.optimizer")

    def switch(optimizer, args, kwargs):
        step = counter.steps  # the counter's own hook ran first
        if step == first:
            torch.cuda.set_sync_debug_mode("error")
        elif step == last:
            torch.cuda.set_sync_debug_mode("default")
    handle = optimizer_hooks.register_optimizer_step_post_hook(switch)
    try:
        yield
    finally:
        handle.remove()
        torch.cuda.set_sync_debug_mode("default")


STEPS = 6  # windows 2..5 are counted: the first two steps compile, and ZeRO-3 records its gather order
# What DeepSpeed's own step waits on, as stock DeepSpeed does it: the functions, and the count per step of the digits
# CNN on each rank of a 1- and a 2-rank run (docs/gpu.md, "No host synchronisation in the app's step").
# ZeRO-3 synchronizes the device after gathering its persistent parameters at the end of each step (2 ranks), or
# waits for the compute stream where a parameter's "gather" is its own partition (1 rank: NoGather handles), and waits
# for the reduction stream at the end of backward. Offload's CPU Adam steps on the host, so the norm and overflow
# checks of the gradients it copies there read them on the host.
DEEPSPEED_WAITS = {
    "zero3": ({"_allgather_params_coalesced", "independent_gradient_partition_epilogue", "wait"},
              {1: [3], 2: [2, 2]}),
    "zero2_offload": ({"update_offload_overflow_tracker", "complete_grad_norm_calculation_for_cpu_offload",
                       "is_invalid_grad_norm"}, {1: [20], 2: [14, 12]}),
    "zero3_offload": ({"_allgather_params_coalesced", "independent_gradient_partition_epilogue", "wait",
                       "complete_grad_norm_calculation_for_cpu_offload", "is_invalid_grad_norm"},
                      {1: [6], 2: [5, 5]}),
}
DEEPSPEED_WAITS["bf16 zero3"] = DEEPSPEED_WAITS["zero3"]  # the "bf16" section's 16-bit weights: the same waits


def sync_job(name, compile_mode, out, *extra):
    return ["--deepspeed_config", REPO_PATH / "ds_configs" / f"{name}.json", "--max_steps", STEPS, "--log_interval",
            STEPS, "--eval_interval", STEPS, "--compile", compile_mode, "--output_dir", out, *extra]


def counted(report) -> list:
    """Every (rank, window, source, count) the job counted."""
    return [(rank, window, source, count) for rank, windows in enumerate(report["ranks"])
            for window, sources in windows.items() for source, count in sources.items()]


def check_report(name, report):
    """No host sync in any counted step on any rank; where DeepSpeed's own step waits, exactly the documented ones."""
    assert report["code"] == 0, report["output"][-2000:]
    assert all(len(windows) == STEPS - 2 for windows in report["ranks"]), report["ranks"]
    found = counted(report)
    if name not in DEEPSPEED_WAITS:
        assert not found, f"{name} waits on the device: {found}"
        return
    functions, per_step = DEEPSPEED_WAITS[name]
    assert {source.split()[-1] for _, _, source, _ in found} <= functions, found
    ranks = len(report["ranks"])
    for rank in range(ranks):
        counts = [sum(c for r, w, _, c in found if (r, w) == (rank, window)) for window in report["ranks"][rank]]
        assert counts == [per_step[ranks][rank]] * (STEPS - 2), f"{name}, rank {rank} of {ranks}: {counts}"


def check_preference_waits(tmp_path, base_env=None, **env):
    """Preference jobs on 2 ranks, eager, against each reference (tests/e2e/test_host_syncs.py, and on a GPU
    tests/e2e/test_cuda.py): no wait but the model's own and, at ZeRO 3, DeepSpeed's documented ones."""
    from app.tools.instructions import write_model, write_pairs
    # 1,000 pairs: no epoch ends inside the counted steps (a new epoch's order is drawn on the host)
    llama = ["--model", write_model(tmp_path, seed=0, layers=1), "--dataset", write_pairs(tmp_path, 1000, seed=0),
             "--block_size", 64, "--eval_answers", 0]
    names = {"frozen copy at ZeRO 0": ("dp",), "frozen copy at ZeRO 2": ("zero2",),
             "adapters off at ZeRO 0": ("dp", "--lora"), "adapters off at ZeRO 3": ("zero3", "--lora"),
             "precomputed at ZeRO 1": ("zero1", "--reference", "precompute")}
    jobs = [sync_job(name, "off", tmp_path / label.replace(" ", "-"), *llama, *extra)
            for label, (name, *extra) in names.items()]
    for label, report in zip(names, count_in_launch(2, jobs, base_env=base_env, **env)):
        assert report["code"] == 0 and f"reference: {label.split(' at ')[0]}" in report["output"], report["output"]
        found = counted(report)
        model = [(rank, window, count) for rank, window, source, count in found if "masking_utils.py" in source]
        assert all(count == (1 if label.startswith("precomputed") else 2) for _, _, count in model), (label, found)
        rest = [f for f in found if "masking_utils.py" not in f[2]]
        if "ZeRO 3" not in label:
            assert not rest, (label, rest)
            continue
        # ZeRO-3: DeepSpeed's own waits of every step, as for any ZeRO-3 run, and no more: the reference's forward
        # is part of the step's recorded gather order (app/ds/internals: forward_within_the_step)
        functions, per_step = DEEPSPEED_WAITS["zero3"]
        assert {source.split()[-1] for _, _, source, _ in rest} <= functions, rest
        for rank in range(2):
            counts = [sum(c for r, w, _, c in rest if (r, w) == (rank, window)) for window in report["ranks"][rank]]
            assert counts == [per_step[2][rank]] * (STEPS - 2), (label, rank, counts)


def count_in_launch(nproc: int, jobs: list, *flags, base_env=None, **env) -> list:
    """Each job's report from one launch of this script with nproc ranks (conftest.launch_script, with env added):
    {"code", "output", "ranks": [{window: {source: count}}]} (for the tests)."""
    import tempfile
    from conftest import launch_script, log_launch, told
    with tempfile.TemporaryDirectory() as folder:
        jobs_file = Path(folder) / "jobs.json"
        jobs_file.write_text(json.dumps([[str(a) for a in job] for job in jobs]))
        result = launch_script(nproc, "tests/helpers/host_syncs.py", jobs_file, folder, *flags, base_env=base_env,
                               **env)
        assert result.returncode == 0, told(result, 3000, 3000)
        reports = [json.loads((Path(folder) / f"{i}.json").read_text()) for i in range(len(jobs))]
    for job, report in zip(jobs, reports):  # one log line per job too
        log_launch(["job:", *job], report["seconds"])
    return reports


def as_on_a_gpu(ds: dict, settings) -> dict:
    """ds with ZeRO-3's "auto" persistence filled as a GPU's run fills it (app/ds/auto.py): CPU ranks persist no
    weight, so DeepSpeed's gather of the persistent ones after each step, and its wait, would go uncounted."""
    from app.core import resolver
    from app.ds import auto as ds_auto
    key = "stage3_param_persistence_threshold"
    zero = ds.get("zero_optimization") or {}
    if zero.get(key) != ds_auto.AUTO:
        return ds
    facts = resolver.auto_facts(resolver.spec_of(settings), "cuda")
    value = ds_auto.fill({"zero_optimization": {key: ds_auto.AUTO}}, facts, 1)[0]["zero_optimization"].get(key)
    zero = {k: v for k, v in zero.items() if k != key} | ({key: value} if value is not None else {})
    return {**ds, "zero_optimization": zero}


def main(jobs_file: str, report: str, *flags):
    from app import train
    from app import settings as config
    from app.distributed import dist
    from app.ds import config as ds_config
    from app.distributed import launch
    launch.prepare_environment()
    parsed = []
    for argv in json.loads(Path(jobs_file).read_text()):
        settings, _ = config.parse(argv)
        ds = ds_config.load_ds_config(settings.deepspeed_config, cuda=True, bf16_ok=True)  # as on a GPU
        parsed.append((settings, as_on_a_gpu(ds, settings)))
    world = launch.setup(timeout_s=300)
    try:
        for i, (settings, ds) in enumerate(parsed):
            counter = HostSyncs(world.device)
            steps = settings.max_steps
            cuda = cuda_errors_between(counter, 2, steps) if "--cuda_errors" in flags else contextlib.nullcontext()
            printed, started = io.StringIO(), time.perf_counter()
            with contextlib.redirect_stdout(printed), counter, cuda:
                code = train.run(settings, ds, world, time.perf_counter())
            windows = counter.per_step(steps, 2)
            counts = dist.gather_objects({k: dict(v) for k, v in windows.items()})
            if world.rank == 0:
                Path(report, f"{i}.json").write_text(json.dumps({"code": code, "output": printed.getvalue(),
                                                                 "ranks": counts,
                                                                 "seconds": time.perf_counter() - started}))
            torch._dynamo.reset()
    finally:
        dist.teardown()


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
    from app import train as _train
    _train.exit_now(0)
