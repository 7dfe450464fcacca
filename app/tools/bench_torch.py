"""The benchmark's torch modes (raw, raw-compile, raw-1thread, ddp, dataparallel): a hand-written PyTorch loop on the
plain model, the peer the app's step is measured against; fsdp2 (bench_fsdp.py) trains with the same loop."""
import torch

from app.ds import precision
from app.tools.bench_common import DTYPES, TimedLoader, Workload, build_model, param_bytes


def run_torch(mode, args, world, work: Workload, loader, clock, total):
    """A hand-written PyTorch loop: the plain model (DDP / DataParallel wrapped), torch AdamW as the reference file
    has it (fused where it says, as the app's step), clipping, autocast in --dtype; raw-compile adds torch.compile
    of model and loss and the fused AdamW always, PyTorch at its best."""
    model = build_model(work).to(world.device)
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif mode == "dataparallel":
        model = torch.nn.DataParallel(model)
    compiled = mode == "raw-compile"
    forward = torch.compile(model, dynamic=False) if compiled else model
    train(model, forward, compiled, args, world, work, loader, clock, total)
    return None, DTYPES[args.dtype], compiled, param_bytes(model)


def train(model, forward, compiled, args, world, work: Workload, loader, clock, total) -> list:
    """The torch modes' loop, `total` steps: forward under autocast in --dtype, loss, backward, clipping and AdamW as
    args.reference says (AdamW fused where it says, as the app's modes step, and always compiled; the loss compiled
    where compiled), a clock tick; each step's loss, on the device."""
    given = args.reference["optimizer"]["params"]
    params = {k: v for k, v in given.items() if k not in ("torch_adam", "fused")}
    optimizer = torch.optim.AdamW(model.parameters(), **params, **({"fused": True} if compiled or given.get("fused")
                                                                   else {}))
    loss_fn = lambda logits, y: work.task.loss(logits, y).mean()  # noqa: E731 (equal-length samples: the mean)
    loss_fn = torch.compile(loss_fn, dynamic=False) if compiled else loss_fn
    clip = args.reference.get("gradient_clipping", 0.0)
    batches = iter(TimedLoader(loader, clock, endless=True))
    dtype, losses = DTYPES[args.dtype], []
    precision.set_tf32(world.device, dtype, "on")  # as the app sets it for fp32 on CUDA
    model.train()
    for _ in range(total):
        x, y, _ = next(batches)
        x, y = x.to(world.device, non_blocking=True), y.to(world.device, non_blocking=True)
        with torch.autocast(world.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn(forward(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()
        losses.append(loss.detach())
    return losses
