"""Launch time: which launcher started us, its variables, the device and backend, the start-up rendezvous.

The only module that reads launcher variables (RANK, OMPI_*, SLURM_*). Run-time helpers live in
app/distributed/dist.py.
"""
import contextlib
import datetime
import json
import logging
import os
import re
import socket
import sys
import warnings

import torch
import torch.distributed as torch_dist

from app.ds import internals as ds_internals
from app.distributed import endings, wire
from app.distributed.cores import usable_cores
from app.distributed.dist import World, barrier, start_host_group
from app.errors import Ended, UserError


# How long the ranks wait for each other at start (at most --dist_timeout): a healthy launch meets in
# seconds, and a node that never started must end the run soon, naming it, instead of hanging it.
JOIN_TIMEOUT_S = 120
# How long a rank that ended on a mistake before the ranks met tries to tell rank 0 (which may have ended on it too).
TELL_S = 30
DEFAULT_MASTER_PORT = 29500


MPI_NAMES = {  # what each MPI's mpirun tells its ranks: rank, world size, local rank, ranks on the node
    "OMPI_COMM_WORLD_RANK": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                             "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI (deepspeed --launcher openmpi)
    "MV2_COMM_WORLD_RANK": ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
                            "MV2_COMM_WORLD_LOCAL_SIZE"),  # MVAPICH2 (deepspeed --launcher mvapich)
    "MPI_LOCALRANKID": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH's, Intel MPI's Hydra
}


def detect_launcher(env=os.environ) -> str:
    """Name the launcher that started this process, or 'none' (also for a shell srun --pty opened on the
    allocation, whose one task is the shell, not the run)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        if "TORCHELASTIC_RUN_ID" in env:
            return "torchrun"
        if "CROSS_RANK" in env or "LOCAL_SIZE" in env:
            return "deepspeed"
        return "env"
    if any(key in env for key in MPI_NAMES):
        return "mpirun"
    shell = "SLURM_PTY_PORT" in env and env.get("SLURM_NTASKS", "1") == "1"  # srun --pty's one task: a shell
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and not shell:  # a task of srun, not the batch script
        return "srun"
    return "none"


def launcher_env(launcher: str, env=os.environ) -> dict:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, MASTER_ADDR and MASTER_PORT for a task of mpirun or srun."""
    if launcher == "mpirun":
        if "MASTER_ADDR" not in env:
            raise UserError("mpirun did not pass MASTER_ADDR: add MASTER_ADDR=<first host> to .deepspeed_env "
                            "(deepspeed --launcher openmpi or mvapich), or pass it to mpirun (-x MASTER_ADDR=<first "
                            "host> for Open MPI, -genv MASTER_ADDR <first host> for MPICH, Intel MPI, MVAPICH)")
        names = next(names for key, names in MPI_NAMES.items() if key in env)
        master = (env["MASTER_ADDR"], env.get("MASTER_PORT", str(DEFAULT_MASTER_PORT)))
    else:
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "")
        nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", ""))
        # a port of its own per job, so two jobs sharing a node do not collide
        master = (env.get("MASTER_ADDR", first_host(nodelist)),
                  env.get("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)))
    rank, world_size, local_rank, local_size = (env.get(name, "") for name in names)
    if launcher == "srun":
        local_size = str(tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1")),
                                       int(env.get("SLURM_NODEID", "0"))))
    return {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": local_rank, "LOCAL_SIZE": local_size,
            "MASTER_ADDR": master[0], "MASTER_PORT": master[1]}


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    match = re.match(r"([^,\[]+)(?:\[([^-,\]]+))?", nodelist)
    if not match:
        raise UserError("srun gave no node list (SLURM_STEP_NODELIST); set MASTER_ADDR to the first node's address")
    return match.group(1) + (match.group(2) or "")


def tasks_on_node(spec: str, node_id: int) -> int:
    """Tasks Slurm runs on node node_id, from a tasks-per-node spec like '2(x3),1'."""
    counts = []
    for part in spec.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts[node_id]


def node_of(launcher: str, env=os.environ, world_info=None) -> tuple:
    """(name, key) of this rank's node: the name users know it by, and what tells nodes apart."""
    hostname = socket.gethostname()
    if launcher == "deepspeed":
        hosts = list(ds_internals.launcher_world_info() if world_info is None else world_info)
        index = int(env.get("CROSS_RANK", "0"))
        return (hosts[index] if index < len(hosts) else hostname), str(index)
    if launcher == "torchrun":
        return hostname, env.get("GROUP_RANK", "0")
    if launcher == "srun":
        return env.get("SLURMD_NODENAME", hostname), env.get("SLURM_NODEID", "0")
    if launcher == "mpirun":  # ranks are placed node by node (by slot): the node's first rank tells it apart
        rank, _, local_rank, _ = next(names for key, names in MPI_NAMES.items() if key in env)
        return hostname, str(int(env[rank]) - int(env[local_rank]))
    return hostname, "0"


def describe_nodes(nodes: list) -> str:
    """'2 node(s): a (ranks 0-1), b (ranks 2-3)' from each rank's (name, key); same-named nodes get '#key'."""
    ranks_by_node = {}
    for rank_, node in enumerate(nodes):
        ranks_by_node.setdefault(tuple(node), []).append(rank_)
    names = [name for name, _ in ranks_by_node]
    parts = []
    for (name, key), ranks in ranks_by_node.items():
        label = f"{name}#{key}" if names.count(name) > 1 else name
        span = f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1 \
            else ",".join(map(str, ranks))
        parts.append(f"{label} (rank{'s' if len(ranks) > 1 else ''} {span})")
    return f"{len(ranks_by_node)} node(s): {', '.join(parts)}"


def plan_without_launcher(gpu_count: int, single_process: bool) -> tuple:
    """Decide ('cpu' | 'gpu' | 'relaunch', reason) when no launcher started us."""
    if gpu_count == 0:
        return "cpu", "no launcher and no GPU: one CPU process with gloo"
    if gpu_count == 1:
        return "gpu", "no launcher and one GPU: plain single-device training on cuda:0"
    if single_process:
        return "gpu", f"no launcher, {gpu_count} GPUs, --single_process: one process on cuda:0"
    return "relaunch", f"no launcher and {gpu_count} GPUs: relaunching through the deepspeed launcher on all of them"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody is listening on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict:
    """The variables a launcher gives rank `rank` of `world_size` ranks on this one machine (127.0.0.1:port)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _relaunch():
    """Replace this process with the deepspeed launcher running the same command on every GPU, rank 0 listening
    on MASTER_PORT or else on a port free now (two such runs on one machine must not both take 29500)."""
    port = os.environ.get("MASTER_PORT") or str(free_port())
    print(f"relaunching: rank 0's rendezvous store listens on 127.0.0.1:{port} only", flush=True)
    spec = sys.modules["__main__"].__spec__  # python -m app.tools.commcheck: each rank runs the module, as asked
    script = ["--module", spec.name] if spec is not None else [sys.argv[0]]
    argv = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--master_port", port, *script, *sys.argv[1:]]
    os.execv(sys.executable, argv)


def prepare_environment():
    """Settle what DeepSpeed reads from the environment before it is imported."""
    # JIT op builds run `ninja` from PATH; two ninjas (system and venv) disagree on their build logs
    # and rebuild every op from scratch each time the other one ran, so always use this Python's own.
    bin_dir = os.path.dirname(sys.executable)
    if not os.environ.get("PATH", "").startswith(bin_dir + os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    # DeepSpeed's throughput timer (time.time) runs in the engine's forward pre-hook: under torch.compile
    # it is a graph break before the model's graph, harmless, and torch warns about it on every rank
    warnings.filterwarnings("ignore", message="Dynamo does not know how to trace the builtin `time.time")
    # Name DeepSpeed's accelerator when there is no GPU, sparing every rank its detection warning.
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    ds_internals.cpu_info_once()  # each CPU optimizer DeepSpeed builds would ask three times, a process each


# Several ranks on one GPU, to try a multi-rank config (ZeRO-3 on 2 ranks, a pipeline) on a machine with one GPU:
# every local rank takes cuda:0, and the device group is gloo registered for CUDA alone, which refuses a CPU tensor as
# NCCL does (NCCL refuses two ranks on one GPU). docs/gpu.md, "Several ranks on one GPU".
SHARE_GPU = "APP_SHARE_GPU"


def gpu_index(local_rank: int, visible: int) -> int:
    """The GPU a local rank takes among the visible ones, or -1 when it has none.

    A launcher that binds one GPU to each task (srun --gpus-per-task=1) leaves each rank one visible
    device, its own, whatever its local rank."""
    return local_rank if local_rank < visible else 0 if visible == 1 else -1


def _device(local_rank: int, local_world_size: int) -> tuple:
    """(device, backend) of this rank: its own GPU with NCCL, or the CPU (its share of the cores) with gloo."""
    if not torch.cuda.is_available():
        if "OMP_NUM_THREADS" not in os.environ:  # ranks on one node share its cores instead of fighting
            torch.set_num_threads(max(1, usable_cores() // local_world_size))
        return torch.device("cpu"), "gloo"
    if os.environ.get(SHARE_GPU) == "1":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0), "cuda:gloo"
    count = torch.cuda.device_count()
    index = gpu_index(local_rank, count)
    if index < 0:
        raise UserError(f"local rank {local_rank} has no GPU: this node shows {count} to each rank; start at "
                        f"most {count} processes per node, or bind one GPU to each (srun --gpus-per-task=1)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index), "nccl"


def setup(single_process: bool = False, timeout_s: int = 600) -> World:
    """Pick the device, meet the other ranks and start the process group, which DeepSpeed then adopts."""
    import deepspeed
    launcher = detect_launcher()
    if launcher == "none":
        mode, description = plan_without_launcher(torch.cuda.device_count(), single_process)
        if mode == "relaunch":
            print(description, flush=True)
            _relaunch()
        os.environ.update(rank_env(0, 1, free_port()))
    else:
        if launcher in ("mpirun", "srun"):  # say it in the variables torch and DeepSpeed read
            os.environ.update(launcher_env(launcher))
        if "MASTER_ADDR" not in os.environ:
            raise UserError(f"RANK and WORLD_SIZE are set (the {launcher} launcher) but MASTER_ADDR is not: set "
                            f"MASTER_ADDR to rank 0's host and MASTER_PORT to a free port there, as torchrun does")
        os.environ.setdefault("MASTER_PORT", str(DEFAULT_MASTER_PORT))
        description = f"started by {launcher}"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    device, backend = _device(local_rank, local_world_size)
    ds_internals.pin_device(device.index or 0)  # DeepSpeed would take the GPU numbered LOCAL_RANK
    ds_internals.quiet_deepspeed(rank)
    node = node_of(launcher)
    nodes = _join(rank, world_size, node, backend, device, min(timeout_s, JOIN_TIMEOUT_S), timeout_s)
    with ds_internals.op_loads_quiet():  # DeepSpeed adopts the process group _join started
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
    if device.type == "cpu" and os.environ.get("LOCAL_SIZE") == str(world_size):  # DeepSpeed made the segments
        barrier()  # every rank has mapped every segment
        ds_internals.drop_shm_names(rank)
    description += f"; {world_size} rank(s) on {describe_nodes(nodes)}; {backend} on {device.type}"
    return World(rank, local_rank, world_size, local_world_size, device, backend, launcher, description, node[0])


def _join(rank: int, world_size: int, node: tuple, backend: str, device, join_s: int, timeout_s: int) -> list:
    """Meet every rank at MASTER_ADDR:MASTER_PORT, start the process group there; return each rank's node.

    torch's own rendezvous waits the whole --dist_timeout for a rank that never started and then names
    nobody; here rank 0 waits at most join_s and names the ranks and hosts that are missing.
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"  # torchrun's agent serves it
    try:
        store = wire.open_store(addr, port, world_size, serve, datetime.timedelta(seconds=join_s))
    except (RuntimeError, torch_dist.DistError) as e:
        if serve:
            raise UserError(f"rank 0 cannot listen on {addr}:{port} ({str(e).splitlines()[0]}); pass a free port "
                            f"(the launcher's --master_port, or MASTER_PORT)") from None
        raise UserError(f"rank {rank} on {node[0]} could not reach rank 0 at {addr}:{port} within {join_s} s: "
                        f"is that node up, and is the port open between the nodes?") from None
    # a restarted torchrun worker group meets again in the same agent store: keep each attempt apart
    store = torch_dist.PrefixStore(f"app/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    keys = [f"node/{r}" for r in range(world_size)]
    store.set(keys[rank], json.dumps(node))
    endings.agree_on_start(store, keys, rank, node, join_s)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    nodes = [tuple(wire.decode(store.get(key), f"the rendezvous store's key {key}", list)) for key in keys]
    torch_dist.init_process_group(backend, store=store, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s),
                            # as DeepSpeed does: bind the GPU, except alone (later new_group()s would need a peer)
                            **({"device_id": device} if backend == "nccl" and world_size > 1 else {}))
    start_host_group(datetime.timedelta(seconds=timeout_s))
    return nodes


def said_before_start(error: UserError):
    """A mistake that ended this rank before the ranks met (its flags, its files): on a rank other than 0 of a
    launch, told to rank 0 through the store, which says it for the run (Ended: this rank says nothing), or kept
    quiet where rank 0 cannot be reached (it ended too, saying its own); on rank 0, or alone, its own to say."""
    launcher, env = detect_launcher(), dict(os.environ)
    with contextlib.suppress(UserError):  # mpirun and srun say the rank in variables of their own
        env.update(launcher_env(launcher) if launcher in ("mpirun", "srun") else {})
    if launcher == "none" or int(env.get("RANK", "0")) == 0 or "MASTER_ADDR" not in env:
        return
    with contextlib.suppress(RuntimeError, torch_dist.DistError, ValueError):
        store = wire.open_store(env["MASTER_ADDR"], int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
                                int(env.get("WORLD_SIZE", "1")), False, datetime.timedelta(seconds=TELL_S))
        store = torch_dist.PrefixStore(f"app/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        store.set(f"said/{env['RANK']}", wire.encode(str(error)))
    raise Ended() from None
