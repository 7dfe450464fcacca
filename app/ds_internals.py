"""Every place the app touches DeepSpeed's private internals, in one module.

Each function here relies on something DeepSpeed does not promise to keep: attribute names of its engine and
optimizers, the shape of its launcher's arguments, file names it picks. They were written against
WRITTEN_FOR; `version_note()` says in one line what to do when another version is installed.
"""
import base64
import contextlib
import json
import os

import psutil
import torch

WRITTEN_FOR = "0.19.8"


def version_note() -> str:
    """'' on the DeepSpeed version this module was written for, else one line saying what to do."""
    import deepspeed
    if deepspeed.__version__ == WRITTEN_FOR:
        return ""
    return (f"warning: DeepSpeed {deepspeed.__version__} is installed but app/ds_internals.py was written for "
            f"{WRITTEN_FOR}; install deepspeed=={WRITTEN_FOR} (requirements.txt), or check each function in "
            f"app/ds_internals.py against this version")


# -- launcher ------------------------------------------------------------------------------------------------

def launcher_world_info() -> dict:
    """{host: slots} in hostfile order, as deepspeed's launch.py (our parent) was given it; {} otherwise."""
    with contextlib.suppress(psutil.Error, ValueError):
        for arg in psutil.Process().parent().cmdline():
            if arg.startswith("--world_info="):
                return json.loads(base64.urlsafe_b64decode(arg.split("=", 1)[1]))
    return {}


def drop_shm_names(rank: int):
    """Remove the name of this rank's /dev/shm segment; call once every rank of the node has mapped them all.

    On CPU, DeepSpeed's comm backend gives each rank of an all-local group a 69 MB shared-memory
    segment (for its inference all-reduce) and never removes it: every run would leave them behind
    until /dev/shm fills the machine's memory. The mappings stay valid after the name is gone.
    """
    path = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_" \
           f"{os.environ.get('MASTER_PORT')}_{rank}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# -- config --------------------------------------------------------------------------------------------------

class Recorder(dict):
    """A dict that remembers which keys DeepSpeed's config parser looked at."""

    def __init__(self, data):
        super().__init__({k: Recorder(v) if isinstance(v, dict) else v for k, v in data.items()})
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def parse_config(ds: dict):
    """Run DeepSpeed's own config parser on ds (in place: a Recorder records what it read), batch sizes made
    consistent for one rank."""
    from deepspeed.runtime.config import DeepSpeedConfig
    micro, accum = ds.get("train_micro_batch_size_per_gpu"), ds.get("gradient_accumulation_steps", 1)
    if isinstance(micro, int) and isinstance(accum, int):
        dict.__setitem__(ds, "train_batch_size", micro * accum)
    return DeepSpeedConfig(ds)


def scalar_defaults() -> dict:
    """{top-level key: DeepSpeed's default} for its scalar settings that have one (runtime/constants.py)."""
    from deepspeed.runtime import constants
    found = {}
    for name, key in vars(constants).items():
        default = getattr(constants, f"{name}_DEFAULT", None) if isinstance(key, str) else None
        if isinstance(default, (bool, int, float, str)):
            found[key] = default
    return found


def section_fields(model_title: str) -> set:
    """The field names of DeepSpeed's pydantic config model called model_title (ZeRO and precision sections)."""
    import deepspeed.runtime.precision_config as precision
    import deepspeed.runtime.zero.config as zero
    for module in (zero, precision):
        for cls in vars(module).values():
            if getattr(cls, "__name__", None) == model_title and hasattr(cls, "model_fields"):
                return set(cls.model_fields)
    return set()


# -- engine --------------------------------------------------------------------------------------------------

def lighten_plain_step(engine):
    """Drop work plain fp32 data parallel does not need (measured with app.tools.bench: ~20% of a small model's
    step). Only for ZeRO stage 0 without fp16/bf16, where every rank holds every gradient.

    DeepSpeed's clipping takes one norm per tensor and all-reduces the total every step (for MoE
    models, whose grads differ by rank); after the gradient all-reduce every rank holds the same
    grads, so torch's foreach clip gives the same norm with no collective. One rank has nothing to
    average, so its gradient all-reduce (a flatten, a collective and a copy back) is skipped.
    """
    import torch.distributed as dist
    engine.clip_fp32_gradients = lambda: torch.nn.utils.clip_grad_norm_(
        engine.module.parameters(), engine.gradient_clipping(), foreach=True)
    if dist.get_world_size() == 1:
        engine.enable_backward_allreduce = False


# The ZeRO optimizer whose step is running, while its inner optimizer skips a bad step on the device itself.
_deciding_on_device = []


def skip_bad_steps_on_device(engine) -> bool:
    """Move ZeRO 1-3's "is the gradient norm finite?" decision from the host to the device; True if done.

    DeepSpeed's ZeRO optimizers ask `is_invalid_grad_norm(norm)` (a `bool()` of a device tensor: the host
    waits for the whole backward) before every step, to skip a step whose norm is inf or NaN, and once more
    to guard the clip. A fused torch optimizer can skip a step on the device instead, as it does for torch's
    GradScaler: given `found_inf`, its kernel leaves the weights, moments and step count as they were. While
    this engine's step runs, the check records the norm's verdict as `found_inf` and answers "valid" to the
    host, so no sync is left and a bad step is still skipped. Offload's CPU Adam keeps DeepSpeed's check.
    """
    from deepspeed.runtime.zero import stage3, stage_1_and_2
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", None)
    if engine.zero_optimization_stage() == 0 or not getattr(inner, "_step_supports_amp_scaling", False):
        return False
    for module in (stage_1_and_2, stage3):
        if not hasattr(module.is_invalid_grad_norm, "deepspeed_original"):
            module.is_invalid_grad_norm = _norm_check_on_device(module.is_invalid_grad_norm)
    step = optimizer.step

    def step_deciding_on_device(*args, **kwargs):
        _deciding_on_device.append(inner)
        try:
            return step(*args, **kwargs)
        finally:
            _deciding_on_device.pop()
            inner.found_inf = None  # a later step outside this path (none today) must not reuse a verdict
    optimizer.step = step_deciding_on_device
    return True


def _norm_check_on_device(original):
    def is_invalid_grad_norm(norm):
        if _deciding_on_device and torch.is_tensor(norm):
            verdict = (~torch.isfinite(norm) | (norm < 0)).any().to(torch.float32)
            _deciding_on_device[-1].found_inf = verdict.to(norm.device).reshape(())
            return False
        return original(norm)
    is_invalid_grad_norm.deepspeed_original = original
    return is_invalid_grad_norm


def count_every_stage_in_grad_norm(module):
    """Make gradient clipping on a pipeline use the norm of the whole model's gradients.

    DeepSpeed sums the stages' squared gradient norms over the pipeline's model-parallel group, but a
    stage other than the first adds a parameter only when it carries `model_parallel` (Megatron's
    mark), which PipelineModule never sets: every stage would clip by stage 0's norm alone. Each
    stage's own parameters are marked; copies of tied ones (ds_pipe_replicated) stay counted once.
    """
    for param in module.parameters():
        if not getattr(param, "ds_pipe_replicated", False):
            param.model_parallel = True


def gathered_state_dict(engine):
    """The whole model's state dict on rank 0 (None elsewhere) from a tensor-parallel engine's shards; every rank
    must call it. DeepSpeed's own helper, named for the 16-bit export it was written for, keeps each dtype."""
    return engine._consolidated_16bit_state_dict()


def drop_other_stages(module):
    """Let go of the layers other stages hold: PipelineModule keeps every layer it was given in _layer_specs,
    which it reads only while it partitions and ties them, so each rank would keep the whole model on the host."""
    for index in range(len(module._layer_specs)):
        if not module._local_start <= index < module._local_stop:
            module._layer_specs[index] = None


def forget_parallel_groups():
    """Let the next engine of this process pick its own groups: a pipeline engine leaves its grid in DeepSpeed's
    module-level `groups.mpu`, where a later plain engine would look up its model-parallel rank."""
    from deepspeed.utils import groups
    groups.mpu = None


def engine_hooks_eager(engine):
    """Run the engine's own forward hooks outside a compiled graph.

    They read DeepSpeed's step counters (micro_steps, ...), on which a traced hook would guard, so the
    model would recompile at every step until torch's recompile limit turns compilation off; AutoTP's
    first-forward check of the inputs pickles them for a broadcast, which tracing cannot. ZeRO-3's hooks
    on every submodule run eager too: traced, those after a submodule recompile once per output shape
    until torch's recompile limit (8) turns them eager with a warning on every rank, and the one before
    each submodule is eager in DeepSpeed itself, so the graphs end at submodule boundaries either way.
    """
    module = engine.module
    handles = [(module._forward_pre_hooks, engine.module_forward_pre_hook),
               (module._forward_hooks, engine.module_forward_post_hook)]
    check = getattr(engine, "first_dataloader_check", None)  # AutoTP's first-forward broadcast of the inputs
    if check is not None and check.id in module._forward_pre_hooks:
        handles.append((module._forward_pre_hooks, check))
    for hooks, handle in handles:
        hooks[handle.id] = torch.compiler.disable(hooks[handle.id])
    offload = getattr(engine.optimizer, "parameter_offload", None)  # ZeRO-3's hooks on every submodule
    for handle in (offload.forward_hooks + offload.backward_hooks) if offload is not None else []:
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            hooks[handle.id] = torch.compiler.disable(hooks[handle.id])


def uncompile(engine):
    """Undo engine.compile(): the module's plain forward from now on."""
    engine.module._compiled_call_impl = None
    engine._is_compiled = False


def replay_cpu_adam_steps(engine):
    """Make DeepSpeed's CPU Adam (offload) continue bit-identically after a checkpoint load.

    Its C++ side keeps beta**step as a running product; a fresh optimizer recomputes it with pow(),
    which rounds differently. Replaying the step count on empty tensors rebuilds the same product.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    inner = getattr(engine.optimizer, "optimizer", None)
    if not isinstance(inner, DeepSpeedCPUAdam):
        return
    steps = max((int(state["step"]) for state in inner.state.values() if "step" in state), default=0)
    group, empty = inner.param_groups[0], torch.empty(0)
    beta1, beta2 = group["betas"]
    for step in range(1, steps + 1):
        inner.ds_opt_adam.adam_update(inner.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                      group["weight_decay"], group["bias_correction"], empty, empty, empty, empty)


def zero_tensors(engine) -> dict:
    """This rank's parameter, gradient, optimizer-moment and fp32 master tensors, as lists, by what they are.

    Read inside an optimizer step (gradients exist only there), from the ZeRO optimizers' own buffers.
    """
    stage, optimizer = engine.zero_optimization_stage(), engine.optimizer
    module_params = list(engine.module.parameters())
    params = [p.ds_tensor if stage == 3 else p for p in module_params]
    if stage == 0:
        grads = [p.grad for p in module_params]
    elif stage == 3:
        grads = [optimizer.grad_partitions_flat_buffer]
    else:
        grads = [g for group in optimizer.averaged_gradients.values() for g in group or ()]  # None between steps
    inner = getattr(optimizer, "optimizer", optimizer)
    moments = [t for state in inner.state.values() for t in state.values()]
    # DeepSpeed's ZeRO optimizers keep an fp32 master partition even when training in fp32
    masters = getattr(optimizer, "single_partition_of_fp32_groups", None) or \
        getattr(optimizer, "fp32_partitioned_groups_flat", [])
    return {"params": params, "grads": grads, "moments": moments, "masters": list(masters)}


def storages(tensors) -> dict:
    """Bytes of each distinct storage behind tensors, by address (views of one flat buffer count once)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors if isinstance(t, torch.Tensor) and t.numel()}


def state_bytes(engine, first: bool) -> int:
    """Bytes a checkpoint takes of this rank (first: data-parallel rank 0): under ZeRO 1-3 its partition of the
    optimizer state, under ZeRO-3 its partition of the weights too; what every rank holds whole (the weights
    below ZeRO-3, all of the optimizer state under ZeRO 0) is saved once, by the first rank."""
    stage, tensors = engine.zero_optimization_stage(), zero_tensors(engine)
    own = {**(storages(tensors["params"]) if stage == 3 or first else {}),
           **(storages(tensors["moments"]) | storages(tensors["masters"]) if stage > 0 or first else {})}
    return sum(own.values())


def module_states(folder) -> dict:
    """The whole module's state dict from a ZeRO stage 0 checkpoint folder (DeepSpeed's own file name for it)."""
    states = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    return states["module"]
