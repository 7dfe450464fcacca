"""Run a script (app/train.py, tests/helpers/jobs.py, ...) with faults injected from outside the app, switched on
through the environment, to make a chosen rank fail at a chosen moment:

    APP_KILL_AT=<moment>:<step>[:<rank>]      SIGKILL at a moment of a checkpoint save: `shards` (DeepSpeed's files
                                              written), `manifest` (every file written, before the manifest),
                                              `pointer` (before the latest pointer); in a first attempt only
    APP_OOM_AT=<micro batch>[:<rank>[:backward]]   torch.OutOfMemoryError in a forward (or backward) of that many
                                              samples or more
    APP_FAIL_COMPILE=<forward|backward>[:<rank>]   inductor refuses the model's forward or backward graph
    APP_PATIENCE_S=<seconds>                  how long a rank that failed alone waits for the others to say theirs

    deepspeed --num_gpus 2 tests/helpers/faults.py <script> <its arguments>

Each is read when its moment comes, so a job of tests/helpers/jobs.py may set its own; unset, each is a no-op.
"""
import os
import runpy
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _wanted(name: str, before_rank: int = 1) -> list:
    """The fields of fault `name` when it is set for this rank (the field after the first before_rank fields names
    one rank; none or empty means every rank), else []."""
    fields = os.environ.get(name, "").split(":")
    if not fields[0] or (len(fields) > before_rank and fields[before_rank] and int(fields[before_rank]) != _rank()):
        return []
    return fields


def _kill_at(moment: str, step: int):
    restarted = any(os.environ.get(name, "0") != "0" for name in ("TORCHELASTIC_RESTART_COUNT", "APP_RESTART_COUNT"))
    wanted = _wanted("APP_KILL_AT", 2)
    if wanted and not restarted and wanted[0] == moment and int(wanted[1]) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def kill_in_saves():
    """The save's moments: after DeepSpeed's save_checkpoint, and before the manifest's and the pointer's write."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from app.checkpoint import save
    save_checkpoint, atomic_write = DeepSpeedEngine.save_checkpoint, save.atomic_write

    def saved(self, save_dir, tag=None, *args, **kwargs):
        done = save_checkpoint(self, save_dir, tag, *args, **kwargs)
        _kill_at("shards", int(str(tag).removeprefix("step")))
        return done

    def written(path, text):
        path = Path(path)
        if path.name in (save.MANIFEST, save.LATEST):
            step = path.parent.name if path.name == save.MANIFEST else text
            _kill_at("manifest" if path.name == save.MANIFEST else "pointer", int(step.removeprefix("step")))
        return atomic_write(path, text)
    DeepSpeedEngine.save_checkpoint, save.atomic_write = saved, written


def out_of_memory():
    """The engine's forward of too many samples raises (with ':backward', its backward pass does); a pipeline's
    train_batch raises before its schedule runs, on every stage alike."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine
    forward, train_batch = DeepSpeedEngine.forward, PipelineEngine.train_batch

    def refused(samples: int, backward: bool):
        wanted = _wanted("APP_OOM_AT")
        if wanted and samples >= int(wanted[0]) and (wanted[2:] == ["backward"]) == backward:
            return torch.OutOfMemoryError(f"out of memory: APP_OOM_AT={os.environ['APP_OOM_AT']} refuses a micro "
                                          f"batch of {samples}")
        return None

    def forward_refused(self, *inputs, **kwargs):
        samples = len(next(t for t in inputs if isinstance(t, torch.Tensor)))
        error = refused(samples, backward=False)
        if error is not None:
            raise error
        output = forward(self, *inputs, **kwargs)
        error = refused(samples, backward=True)
        out = getattr(output, "logits", output)
        if error is not None and getattr(out, "requires_grad", False):
            out.register_hook(lambda grad: (_ for _ in ()).throw(error))
        return output

    def train_batch_refused(self, data_iter=None, *args, **kwargs):
        batches = list(data_iter)
        error = refused(len(batches[0][1][0]), backward=False)  # (inputs, (labels, weights)) per micro batch
        if error is not None:
            raise error
        return train_batch(self, iter(batches), *args, **kwargs)
    DeepSpeedEngine.forward, PipelineEngine.train_batch = forward_refused, train_batch_refused


def refuse_compiles():
    """The engine's compile hands torch.compile an inductor that refuses the graph APP_FAIL_COMPILE names."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine
    compile_engine = DeepSpeedEngine.compile

    def refuse(is_backward: bool):
        wanted = _wanted("APP_FAIL_COMPILE")
        if wanted and is_backward == (wanted[0] == "backward"):
            raise RuntimeError(f"APP_FAIL_COMPILE: inductor refuses this {wanted[0]} graph on rank {_rank()}")

    def inductor_refusing(graph, example_inputs):
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(graph, example_inputs, **kwargs):
            refuse(kwargs.get("is_backward", False))
            return compile_fx_inner(graph, example_inputs, **kwargs)
        with torch._functorch.config.patch(enable_autograd_cache=False):  # every graph reaches inner
            return compile_fx(graph, example_inputs, inner_compile=inner, config_patches={"fx_graph_cache": False})

    def compiled(self, backend="inductor", *args, **kwargs):
        if _wanted("APP_FAIL_COMPILE"):
            backend = inductor_refusing
        return compile_engine(self, backend, *args, **kwargs)
    DeepSpeedEngine.compile = compiled


def impatient():
    """A rank whose part failed waits APP_PATIENCE_S for the others to say theirs, not the seconds the app sets."""
    from app.distributed import endings
    outcomes = endings.Board.outcomes

    def patient(self, mine, failed_after_s=None, patience_s=endings.PATIENCE_S):
        return outcomes(self, mine, failed_after_s, float(os.environ.get("APP_PATIENCE_S") or patience_s))
    endings.Board.outcomes = patient


def main():
    script, *argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher's
    from app.distributed import launch
    launch.prepare_environment()
    for inject in (kill_in_saves, out_of_memory, refuse_compiles, impatient):
        inject()
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
