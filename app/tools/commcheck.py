"""Check the process group: every collective verified, then latency and bus bandwidth by message size.

Launched like training, as a module: `deepspeed --num_gpus 2 --module app.tools.commcheck`,
`torchrun --nproc_per_node 2 -m app.tools.commcheck`, or `python -m app.tools.commcheck` for one rank.
"""
import argparse
import statistics
import sys
import time

import torch
import torch.distributed as torch_dist

from app.distributed import launch
from app.distributed.dist import host_max, print0, teardown
from app.errors import UserError, report


def _filled(value, device, n=4):
    return torch.full((n,), float(value), device=device)


def _check(name, got, want):
    if not torch.equal(got.cpu(), torch.as_tensor(want, dtype=got.dtype).expand_as(got.cpu())):
        raise AssertionError(f"{name}: rank {torch_dist.get_rank()} got {got.tolist()}, expected {want}")


def _verify_ring(device) -> list:
    """Point to point around a ring: send to the next rank, receive from the previous one."""
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    out, into = _filled(rank, device), _filled(-1, device)
    if rank % 2 == 0:
        torch_dist.send(out, nxt)
        torch_dist.recv(into, prev)
    else:
        torch_dist.recv(into, prev)
        torch_dist.send(out, nxt)
    _check("send/recv", into, prev)
    into = _filled(-1, device)
    for work in (torch_dist.isend(_filled(rank * 10, device), nxt), torch_dist.irecv(into, prev)):
        work.wait()
    _check("isend/irecv", into, prev * 10)
    return ["send/recv", "isend/irecv"]


def product_term(rank: int) -> float:
    """Each rank's value in the all_reduce PRODUCT check: -2 on rank 0, -1 on the others. Their product is exact in
    fp32 at any world size (1 x 2 x ... x world is not: above 14 ranks rounding, above 20 an int64 overflow), and
    its sign still counts every rank."""
    return -2.0 if rank == 0 else -1.0


def product_want(world: int) -> float:
    return 2.0 * (-1.0) ** world


def verify_primitives(device) -> list:
    """Run each primitive once with values whose right answer is known; return the names checked."""
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    ranks, ops = list(range(world)), torch_dist.ReduceOp
    torch_dist.barrier()
    checked = ["rank and world size", "barrier"] + (_verify_ring(device) if world > 1 else [])
    value = _filled(rank + 7, device)
    torch_dist.broadcast(value, src=0)
    _check("broadcast", value, 7)
    for op, want in ((ops.SUM, sum(r + 1 for r in ranks)), (ops.MAX, world), (ops.MIN, 1),
                     (ops.PRODUCT, product_want(world))):
        value = _filled(product_term(rank) if op == ops.PRODUCT else rank + 1, device)
        torch_dist.all_reduce(value, op=op)
        _check(f"all_reduce {op}", value, want)
    value = _filled(rank + 1, device)
    torch_dist.reduce(value, dst=0, op=torch_dist.ReduceOp.SUM)
    if rank == 0:
        _check("reduce", value, sum(r + 1 for r in ranks))
    parts = [_filled(-1, device) for _ in ranks]
    torch_dist.all_gather(parts, _filled(rank, device))
    for r, part in enumerate(parts):
        _check("all_gather", part, r)
    parts = [_filled(-1, device) for _ in ranks] if rank == 0 else None
    torch_dist.gather(_filled(rank * 3, device), parts, dst=0)
    if rank == 0:
        for r, part in enumerate(parts):
            _check("gather", part, r * 3)
    into = _filled(-1, device)
    torch_dist.scatter(into, [_filled(r * 5, device) for r in ranks] if rank == 0 else None, src=0)
    _check("scatter", into, rank * 5)
    evens = [r for r in ranks if r % 2 == 0]
    group = torch_dist.new_group(evens)  # every rank takes part in creating it, members only in using it
    if rank in evens:
        value = _filled(1, device)
        torch_dist.all_reduce(value, group=group)
        _check("all_reduce in new_group", value, len(evens))
    torch_dist.barrier()
    checked += ["broadcast", "all_reduce sum/max/min/product", "reduce", "all_gather", "gather", "scatter",
                "new_group subgroup"]
    return checked


# Bus bandwidth factor per collective, as the NCCL tests define it: the bytes each link carries.
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0}


def _timed(op, tensor, world, device, iters):
    parts = [torch.empty_like(tensor) for _ in range(world)]
    run = {"all_reduce": lambda: torch_dist.all_reduce(tensor),
           "broadcast": lambda: torch_dist.broadcast(tensor, src=0),
           "all_gather": lambda: torch_dist.all_gather(parts, tensor)}[op]
    for _ in range(2):
        run()
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    # the slowest rank's median is what the collective cost
    return host_max([statistics.median(times)])[0]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device, sizes, iters) -> list:
    """(op, bytes, seconds, algorithm GB/s, bus GB/s) rows for each collective and message size."""
    world, rows = torch_dist.get_world_size(), []
    for op in BUS_FACTOR:
        for size in sizes:
            tensor = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
            seconds = _timed(op, tensor, world, device, iters)
            nbytes = tensor.numel() * 4
            algbw = nbytes / seconds / 1e9
            rows.append((op, nbytes, seconds, algbw, algbw * BUS_FACTOR[op](world)))
    return rows


def message_sizes(sizes: str, iters: int) -> list:
    """The message sizes of --sizes, checked with --iters before any process group exists."""
    try:
        parsed = [int(size) for size in sizes.split(",")]
    except ValueError:
        raise UserError(f"--sizes {sizes}: give whole numbers of bytes, comma separated, such as 8,1024,65536")
    if min(parsed) < 1 or iters < 1:
        raise UserError(f"--sizes and --iters take numbers of 1 or more (got --sizes {sizes} --iters {iters})")
    return parsed


def main(argv=None) -> int:
    """Verify the primitives, then print the bandwidth table on rank 0; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m app.tools.commcheck", description=__doc__)
    parser.add_argument("--sizes", default="8,1024,65536,1048576,8388608",
                        help="message sizes in bytes, comma separated (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=20, help="timed repetitions per size (default: %(default)s)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher; unused")
    args = parser.parse_args(argv)
    launch.prepare_environment()
    try:
        sizes = message_sizes(args.sizes, args.iters)
        world = launch.setup()
        checked = verify_primitives(world.device)
        print0(f"{world.description}\nverified on {world.world_size} rank(s): {', '.join(checked)}")
        rows = measure(world.device, sizes, args.iters)
        print0(f"{'collective':<12}{'bytes':>12}{'time (us)':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}")
        for op, nbytes, seconds, algbw, busbw in rows:
            print0(f"{op:<12}{nbytes:>12}{seconds * 1e6:>12.1f}{algbw:>12.3f}{busbw:>12.3f}")
        return 0
    except UserError as e:
        return report(e)
    except AssertionError as e:  # a collective gave a wrong answer: the check failed, not the user
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        teardown()


if __name__ == "__main__":
    sys.exit(main())
