"""DeepSpeed's launcher and start-up: the hosts it was given, what its pdsh runner sends the nodes, its
shared-memory segments, its log lines, what its CPU ops ask of the CPU."""
import base64
import contextlib
import copy
import functools
import json
import os
import re

import psutil


def launcher_world_info() -> dict:
    """{host: slots} in hostfile order, as deepspeed's launch.py (our parent) was given it; {} otherwise."""
    with contextlib.suppress(psutil.Error, ValueError):
        for arg in psutil.Process().parent().cmdline():
            if arg.startswith("--world_info="):
                return json.loads(base64.urlsafe_b64decode(arg.split("=", 1)[1]))
    return {}


def started_by_pdsh() -> bool:
    """True in a rank whose launch.py DeepSpeed's pdsh runner started over ssh (not --no_ssh, not one node)."""
    with contextlib.suppress(psutil.Error):
        launcher = psutil.Process().parent()
        if not any(arg.startswith("--world_info=") for arg in launcher.cmdline()):
            return False
        runner = launcher.parent()  # a shell that ssh started, else the runner itself (one node, --no_ssh)
        return not any(os.path.basename(arg) in ("deepspeed", "ds", "deepspeed.launcher.runner")
                       for arg in (runner.cmdline() if runner else [])[:4])
    return False


def node_shell_line() -> tuple:
    """(names exported, launch directory, everything after launch.py's name) as the pdsh runner wrote the nodes'
    shell line (`export N=v; ...; cd <dir>; <python> -u -m deepspeed.launcher.launch <...>`), before a shell
    expanded it; None when it is not to be seen here.

    It is the `-c` of our launch.py's shell, unless that shell ran launch.py in its place (bash does); else, on
    the machine the launch started from, the command line of pdsh (and its ssh) for this launch."""
    with contextlib.suppress(psutil.Error):
        launcher = psutil.Process().parent()
        ours = [f" {arg} " for arg in launcher.cmdline() if arg.startswith(("--world_info=", "--master_port="))]
        for process in [launcher.parent(), *psutil.process_iter()]:
            with contextlib.suppress(psutil.Error, AttributeError):
                line = " ".join(process.cmdline())
                found = re.search(r"[;\s]cd (.*); \S+ -u -m deepspeed\.launcher\.launch (.*)", line, re.S)
                if found and len(ours) == 2 and all(arg in f" {line} " for arg in ours):
                    exported = re.findall(r"[;\s]export ([^=;\s]+)=", line[:found.start() + 1])
                    return exported, found.group(1), found.group(2)
    return None


def pdsh_words(user_args: list) -> list:
    """The arguments as DeepSpeed's pdsh runner writes them into the nodes' shell line (quoted against spaces)."""
    from types import SimpleNamespace
    from deepspeed.launcher.multinode_runner import PDSHRunner
    return PDSHRunner.parse_user_args(SimpleNamespace(args=SimpleNamespace(user_args=list(user_args))))


def pdsh_exports(env, here: str = ".") -> list:
    """(name, where from) of each variable the pdsh runner exports on its command line: set ones named by its
    prefixes (PYTHON, MLFLOW, UCX, MV2, NCCL on GPUs), and every line of .deepspeed_env in ~ and here."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher import runner
    excluded = [name for key, names in runner.EXCLUDE_ENVS.items() if key in env for name in names]
    prefixes = runner.EXPORT_ENVS + get_accelerator().export_envs()
    found = [(name, "environment") for name in env if name.startswith(tuple(prefixes)) and name not in excluded]
    name = env.get("DS_ENV_FILE", ".deepspeed_env")  # read as the runner reads it when it is imported
    for folder in (os.path.expanduser("~"), here):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with contextlib.suppress(OSError, UnicodeDecodeError), open(path) as lines:
                found += [(line.split("=", 1)[0].strip(), path) for line in lines if "=" in line]
    return found


def env_file_problem(env, here: str = ".") -> str:
    """'<file> line <n>: <line>' of the first line of a .deepspeed_env (in ~ and here) that DeepSpeed's runner
    does not read as NAME=value, or ''. It splits each line at its first '=' and exports the rest on the nodes'
    command line: a blank line ends the launcher in a traceback, and a comment's '#' comments out the rest of the
    pdsh line, so the nodes start nothing and the launch exits 0."""
    name = env.get("DS_ENV_FILE", ".deepspeed_env")
    for folder in (os.path.expanduser("~"), here):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with contextlib.suppress(OSError, UnicodeDecodeError), open(path) as lines:
                for number, line in enumerate(lines, 1):
                    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", line.split("=", 1)[0]) or "=" not in line:
                        return f"{path} line {number}: {line.rstrip()!r}"
    return ""


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


# DeepSpeed's lines that tell a user nothing; the rest of its warnings stay. APP_DEEPSPEED_LOG=info shows them all.
NOISE = ("Attempting to get learning rate from scheduler before it has started", "built successfully")


def quiet_deepspeed(rank: int):
    """DeepSpeed's logger on this rank: warnings on rank 0 (errors elsewhere) without its NOISE, unless the user
    asks for its own lines with APP_DEEPSPEED_LOG=<level> (debug, info, warning)."""
    import logging
    from deepspeed.utils import logger
    asked = os.environ.get("APP_DEEPSPEED_LOG", "").upper()
    level = getattr(logging, asked, None) or (logging.WARNING if rank == 0 else logging.ERROR)
    for handler in [logger, *logger.handlers]:  # DeepSpeed's own handler has a level of its own
        handler.setLevel(level)
    if not asked:
        logger.addFilter(lambda record: not any(part in record.getMessage() for part in NOISE))


@contextlib.contextmanager
def op_loads_quiet():
    """Keep the line DeepSpeed prints each time it loads a compiled op ("... built successfully") off stdout,
    unless APP_DEEPSPEED_LOG is set or the load fails (then all it printed is shown)."""
    import io
    import sys
    if os.environ.get("APP_DEEPSPEED_LOG"):
        yield
        return
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    except BaseException:
        sys.stdout.write(printed.getvalue())
        raise


def cpu_info_once():
    """Ask py-cpuinfo about this CPU once per process, not each time DeepSpeed asks.

    Building a CPU optimizer (ZeRO offload's CPU Adam, CPU Lion) calls `cpuinfo.get_cpu_info()` three times (the
    optimizer, then its op builder's cpu_arch and simd_width), and each call starts a Python process of its own
    to read the CPU: 1.1 s apiece on a 2-core machine, every time an engine is built. The CPU does not change
    while the process lives; each caller gets its own copy of the answer."""
    import cpuinfo
    if getattr(cpuinfo.get_cpu_info, "asked_once", False):
        return
    first = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info():
        return copy.deepcopy(first())
    get_cpu_info.asked_once = True
    cpuinfo.get_cpu_info = get_cpu_info


def pin_device(index: int):
    """Make every device DeepSpeed names by number this rank's own device, index.

    DeepSpeed picks the device from LOCAL_RANK, not from the device the process chose: the engine's
    `_set_distributed_vars` and AutoTP call `set_device(local_rank)`, ZeRO-3's `zero.Init` and its rank
    agreement checks use `device_name(os.environ["LOCAL_RANK"])`, a PipelineModule moves itself to
    `device_name(local_rank)`. Where a rank sees one GPU whatever its local rank (srun --gpus-per-task=1)
    or several ranks share one (the tests), local rank 1 would take a GPU that is not there or not its own.
    A process trains on one device, so any index DeepSpeed asks for means that one.
    """
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    set_device, device_name = accelerator.set_device, accelerator.device_name
    if getattr(set_device, "pinned_to", None) is not None:
        set_device, device_name = set_device.deepspeed_original, device_name.deepspeed_original

    def pinned_set_device(device_index):
        set_device(index)

    def pinned_device_name(device_index=None):
        return device_name(None if device_index is None else index)
    pinned_set_device.pinned_to, pinned_set_device.deepspeed_original = index, set_device
    pinned_device_name.deepspeed_original = device_name
    accelerator.set_device, accelerator.device_name = pinned_set_device, pinned_device_name
