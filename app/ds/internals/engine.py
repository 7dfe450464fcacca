"""The engine and its optimizers: the step made lighter and sync-free, compile around its hooks, pipeline
stages, groups left behind."""
import contextlib

import torch


@contextlib.contextmanager
def config_saved_as(engine, config: dict):
    """Inside, engine.save_checkpoint writes `config` as the dict its files hold (their `ds_config`).

    DeepSpeed reads `engine.config` (the dict it was built from) only to copy it into the model-state and
    ZeRO files it saves, and to set up offload while it is built; what it runs on is `engine._config`."""
    built = engine.config
    engine.config = config
    try:
        yield
    finally:
        engine.config = built


def lighten_plain_step(engine):
    """Drop work plain fp32 data parallel does not need (a small model's step loses much of its time to it:
    app.tools.bench shows how much). Only for ZeRO stage 0 without fp16/bf16, where every rank holds every gradient.

    DeepSpeed's clipping takes one norm per tensor and all-reduces the total every step (for MoE
    models, whose grads differ by rank); after the gradient all-reduce every rank holds the same
    grads, so torch's foreach clip gives the same norm with no collective. One rank has nothing to
    average, so its gradient all-reduce (a flatten, a collective and a copy back) is skipped.
    """
    import torch.distributed as torch_dist
    norms = engine.app_bad_norms = BadNorms(engine.device)
    engine.clip_fp32_gradients = lambda: norms.record(~torch.isfinite(torch.nn.utils.clip_grad_norm_(
        engine.module.parameters(), engine.gradient_clipping(), foreach=True)), skipped=False)
    if torch_dist.get_world_size() == 1:
        engine.enable_backward_allreduce = False


def note_clip_norms(engine):
    """ZeRO 0 in fp32 on pipelines and tensor parallelism: DeepSpeed's own clip (whose norm sums the stages' or
    shards' parts), with the norm it returns, which DeepSpeed drops, noted on the device (BadNorms)."""
    from deepspeed.runtime import engine as ds_engine
    norms = engine.app_bad_norms = BadNorms(engine.device)
    engine.clip_fp32_gradients = lambda: norms.record(~torch.isfinite(ds_engine.clip_grad_norm_(
        parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu)), skipped=False)


# The ZeRO optimizer whose step is running, while its inner optimizer skips a bad step on the device itself.
_deciding_on_device = []


class BadNorms:
    """Steps whose gradient norm was not finite, found on the device: `last` is 1 when the latest step's was, and
    `skipped` counts the steps the optimizer skipped for it; both read on the host at log rows only."""

    def __init__(self, device):
        self.last = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)

    def record(self, not_finite: torch.Tensor, skipped: bool = True) -> torch.Tensor:
        """Note a step's verdict (1: the norm was not finite, and the step skipped if `skipped`); returns it."""
        self.last.copy_(not_finite.to(torch.int64))
        if skipped:
            self.skipped += self.last
        return not_finite


def bad_norms(engine):
    """The BadNorms of an engine whose gradient norm the app checks on the device (its step skipped there under ZeRO
    1-3 and bf16 weights; applied as DeepSpeed applies it under ZeRO 0 in fp32), else None: DeepSpeed's own host
    check then counts skipped steps in engine.skipped_steps."""
    return getattr(engine, "app_bad_norms", None)


def count_skipped_steps(engine, skipped: int):
    """Tell DeepSpeed about steps skipped on the device since the last call, as its host check would have: its
    count of skipped steps goes up, and its learning-rate schedule goes back by as many steps (DeepSpeed does not
    advance the schedule on a skipped step; the device cannot tell the host in time, so this catches up)."""
    if skipped <= 0:
        return
    engine.skipped_steps += skipped
    scheduler = engine.lr_scheduler
    if scheduler is not None and hasattr(scheduler, "last_batch_iteration"):  # each of DeepSpeed's schedulers
        scheduler.step(scheduler.last_batch_iteration - skipped)


def skip_bad_steps_on_device(engine) -> bool:
    """Move ZeRO 1-3's "is the gradient norm finite?" decision from the host to the device; True if done.

    DeepSpeed's ZeRO optimizers ask `is_invalid_grad_norm(norm)` (a `bool()` of a device tensor: the host
    waits for the whole backward) before every step, to skip a step whose norm is inf or NaN, and once more
    to guard the clip. A fused torch optimizer can skip a step on the device instead, as it does for torch's
    GradScaler: given `found_inf`, its kernel leaves the weights, moments and step count as they were. While
    this engine's step runs, the check records the norm's verdict as `found_inf` (and counts it, BadNorms)
    and answers "valid" to the host, so no sync is left and a bad step is still skipped. Offload's CPU Adam and
    fp16's loss scaling keep DeepSpeed's check. In bf16, ZeRO 1-2's separate overflow check of every gradient is
    left to the norm's.
    """
    from deepspeed.runtime.zero import stage3, stage_1_and_2
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", None)
    if engine.zero_optimization_stage() == 0 or engine.fp16_enabled() or \
            not getattr(inner, "_step_supports_amp_scaling", False):
        return False
    for module in (stage_1_and_2, stage3):
        if not hasattr(module.is_invalid_grad_norm, "deepspeed_original"):
            module.is_invalid_grad_norm = _norm_check_on_device(module.is_invalid_grad_norm)
    if engine.bfloat16_enabled() and getattr(optimizer, "check_grad_overflow", False) and \
            getattr(optimizer, "compute_grad_norm", False) and not getattr(optimizer, "cpu_offload", False):
        # ZeRO 1-2 in bf16 first ask every gradient for inf or NaN (an all-reduce read back on the host); such a
        # gradient makes the norm inf or NaN too, which the check above then skips on the device
        optimizer.check_overflow = lambda partition_gradients=True: None
    norms = engine.app_bad_norms = BadNorms(engine.device)
    step = optimizer.step

    def step_deciding_on_device(*args, **kwargs):
        _deciding_on_device.append((inner, norms))
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
            inner, norms = _deciding_on_device[-1]
            verdict = (~torch.isfinite(norm) | (norm < 0)).any().to(torch.float32).to(norm.device).reshape(())
            if getattr(inner, "found_inf", None) is None:  # the step's first ask; the clip's guard asks again
                norms.record(verdict)
            inner.found_inf = verdict
            return False
        return original(norm)
    is_invalid_grad_norm.deepspeed_original = original
    return is_invalid_grad_norm


def step_bf16_weights_on_device(engine) -> bool:
    """ZeRO 0 with the bf16 section: DeepSpeed's step (FP16_UnfusedOptimizer, written for fp16's loss scaling)
    reads an overflow flag per gradient, each group's norm and the clip factor on the host. bf16 has no loss
    scale, so the same step runs on the device: fp32 gradients from the bf16 ones, their global norm, the clip
    factor DeepSpeed would take (max_norm / (norm + 1e-6) when below 1), the fused optimizer told found_inf when
    the norm is not finite (it then leaves all as it was; BadNorms counts it), the bf16 weights copied from the
    fp32 masters. True if done."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", None)
    plain = isinstance(optimizer, FP16_UnfusedOptimizer) and engine.bfloat16_enabled() and not engine.has_moe_layers \
        and optimizer.mpu is None  # pipelines and tensor parallelism sum the norm over their model-parallel group
    if not (plain and getattr(inner, "_step_supports_amp_scaling", False) and not optimizer.fused_lamb_legacy
            and optimizer.loss_scale_config.cur_scale == 1):
        return False
    norms = engine.app_bad_norms = BadNorms(engine.device)

    @torch.no_grad()
    def step(closure=None):
        masters = [p for group in optimizer.fp32_groups for p in group]
        weights = [p for group in optimizer.fp16_groups for p in group]
        for master, weight in zip(masters, weights):
            master.grad = torch.zeros_like(master) if weight.grad is None else weight.grad.to(master.dtype)
            weight.grad = None
        grads = [master.grad for master in masters]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        if optimizer.clip_grad > 0:
            torch._foreach_mul_(grads, torch.clamp(optimizer.clip_grad / (norm + 1e-6), max=1.0))
        inner.found_inf = norms.record((~torch.isfinite(norm)).to(torch.float32))
        try:
            inner.step()
        finally:
            inner.found_inf = None
        torch._foreach_copy_(weights, masters)
        for master in masters:
            master.grad = None
        optimizer._global_grad_norm, optimizer.overflow = norm, False  # skipped or not: BadNorms says
        return False
    optimizer.step = step
    return True


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
    """Let a later engine of this process pick its own groups: a pipeline's `groups.mpu`, sequence parallelism's."""
    from deepspeed.utils import groups
    from app.ds.internals.sequence import forget_sequence_groups
    groups.mpu = None
    forget_sequence_groups()


def forget_unfinished_forward():
    """Let go of the modules of a forward that raised: ZeRO-3 pushes each module whose forward is under way onto a
    module-level stack (parameter_offload.FWD_MODULE_STACK) and pops it when the forward ends, so a forward that
    ran out of memory leaves its module there, and through its hooks the whole engine, on the GPU."""
    from deepspeed.runtime.zero import parameter_offload
    parameter_offload.FWD_MODULE_STACK.clear()


def forget_released_params():
    """Let go of every ZeRO-3 engine DeepSpeed's parameter coordinator still remembers. It caches which parameters
    to release after each submodule (an lru_cache on the class, partitioned_param_coordinator.py, keyed by the
    coordinator and the submodule) from an engine's second step on, and so keeps each such engine, its states and
    partitions, alive for the rest of the process, destroyed or not (a llama-1b engine's 24.7 GB on the GPU in the
    benchmark's modes after it). Only where no ZeRO-3 engine is in use: a live one's answers would be worked out
    again."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    released = PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
    for cell in released.__closure__ or ():  # DeepSpeed's nvtx wrapper around the cached function
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()


def engine_hooks_eager(engine):
    """Run the engine's own forward hooks outside a compiled graph.

    They read DeepSpeed's step counters (micro_steps, ...), on which a traced hook would guard, so the
    model would recompile at every step until torch's recompile limit turns compilation off; AutoTP's
    first-forward check of the inputs pickles them for a broadcast, which tracing cannot. ZeRO-3's hooks
    on every submodule run eager too: traced, those after a submodule recompile once per output shape
    until torch's recompile limit (8) turns them eager with a warning on every rank, and the one before
    each submodule is eager in DeepSpeed itself, so the graphs end at submodule boundaries either way.
    Where DeepCompile compiled the step, the engine has taken its own forward hooks off (its passes do their work).
    """
    module = engine.module
    handles = [(module._forward_pre_hooks, engine.module_forward_pre_hook),
               (module._forward_hooks, engine.module_forward_post_hook),
               (module._forward_pre_hooks, getattr(engine, "first_dataloader_check", None))]  # AutoTP's broadcast
    for hooks, handle in handles:
        if handle is not None and handle.id in hooks:
            hooks[handle.id] = torch.compiler.disable(hooks[handle.id])
    offload = getattr(engine.optimizer, "parameter_offload", None)  # ZeRO-3's hooks on every submodule
    for handle in (offload.forward_hooks + offload.backward_hooks) if offload is not None else []:
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            hooks[handle.id] = torch.compiler.disable(hooks[handle.id])


def uncompile(engine):
    """Undo engine.compile(): the module's plain forward from now on. Not where DeepCompile compiled the step
    (deepcompile_active): its set-up took ZeRO's own gradient and gather hooks off for good."""
    engine.module._compiled_call_impl = None
    engine._is_compiled = False


def deepcompile_active(engine) -> bool:
    """Whether DeepSpeed's DeepCompile compiles the engine's step (or has begun to), as its destroy() asks."""
    return engine.is_deepcompile_active() or getattr(engine, "_deepcompile_native_initialized", False)


def autocast_of(engine):
    """The engine's torch_autocast as a context, as its forward runs the module: for the app's own forwards beside
    it (generation)."""
    from deepspeed.runtime.torch_autocast import autocast_if_enabled
    return autocast_if_enabled(engine)


def forward_within_the_step(engine, *inputs):
    """engine(*inputs) as DeepSpeed's forward runs the module (in its torch_autocast), but without the hooks of the
    engine's root module: under ZeRO-3 the root's pre-forward hook starts a new window of the parameter
    coordinator's recorded gather order, so a second forward in each micro step (preference tuning's reference, the
    LoRA adapters off) would make every window differ from the last: DeepSpeed would then drop its recorded order,
    compare module ids across ranks at each window (host reads) and never prefetch. The root module holds no
    parameters of its own (the app's HFLogits wraps the model); its children gather theirs as in any forward."""
    with autocast_of(engine):
        return engine.module.forward(*inputs)
