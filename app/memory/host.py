"""The host's side of the memory plan: the memory a machine gives a run (its RAM, or less where the process's cgroup
caps it, as a container or a Slurm job with --mem does), and whether the states offload keeps there fit it, for all
the ranks of the machine together."""
import os
import socket
from pathlib import Path

# What the ranks' offloaded states may take of a machine's memory: the system and each rank's own process (Python,
# torch and CUDA's libraries, the data) take the rest.
USABLE_HOST = 0.9
CGROUPS = Path("/sys/fs/cgroup")
UNLIMITED = 2**62  # cgroup v1 writes "no limit" as a number near 2**63
MEMORY_LIMIT = {"cgroup2": "memory.max", "memory": "memory.limit_in_bytes"}


def physical_memory() -> int:
    """Bytes of RAM of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo") -> int:
    """The tightest memory limit of this process's cgroup and its ancestors, v2 (memory.max) or v1
    (memory.limit_in_bytes), each hierarchy where mountinfo says it is mounted, in bytes; 0 where none is set or none
    can be read."""
    mounts, limits = cgroup_mounts(_read(Path(mountinfo))), []
    for line in _read(Path(proc_cgroup)).splitlines():
        _, controllers, path = line.split(":", 2)
        kind = "cgroup2" if controllers == "" else "memory" if "memory" in controllers.split(",") else ""
        if kind not in mounts:
            continue
        top, point = mounts[kind]
        if path == top or path.startswith(top.rstrip("/") + "/"):  # the mount shows the hierarchy from top down
            path = path[len(top):]
        parts, name = [part for part in path.split("/") if part], MEMORY_LIMIT[kind]
        for depth in range(len(parts) + 1):  # a namespaced view may not show the outer levels: each one that is there
            text = _read(point.joinpath(*parts[:depth], name))
            if text.isdigit() and 0 < int(text) < UNLIMITED:
                limits.append(int(text))
    return min(limits, default=0)


def cgroup_mounts(mountinfo: str) -> dict:
    """{"cgroup2" or "memory" (v1's controller): (the group the mount shows at its top, where it is mounted)} from
    the text of /proc/self/mountinfo, the first mount of each; the usual places where it names none."""
    found = {}
    for line in mountinfo.splitlines():
        mount, _, filesystem = line.partition(" - ")
        mount, filesystem = mount.split(), filesystem.split()
        if len(mount) < 5 or len(filesystem) < 3:
            continue
        if filesystem[0] == "cgroup2" or (filesystem[0] == "cgroup" and "memory" in filesystem[2].split(",")):
            found.setdefault("cgroup2" if filesystem[0] == "cgroup2" else "memory", (mount[3], Path(mount[4])))
    return found or {"cgroup2": ("/", CGROUPS), "memory": ("/", CGROUPS / "memory")}


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def host_memory() -> int:
    """Bytes of memory this machine gives a run: its RAM, or its cgroup's limit where that is lower."""
    limit, ram = cgroup_limit(), physical_memory()
    return min(limit, ram) if limit else ram


def offloaded(plan) -> int:
    """Bytes one rank keeps on the host under the plan: what offload moves there."""
    return sum(plan.host.values())


def fits(each: int, ranks_here: int, memory: int) -> bool:
    """Whether ranks_here ranks that each offload `each` bytes fit a machine of memory bytes."""
    return each * ranks_here <= USABLE_HOST * memory


def shortfall(each: int, ranks_here: int, memory: int, config: str, weights: bool, adapters: bool,
              stage3: bool = True) -> str:
    """'' where ranks_here ranks that each offload `each` bytes fit this machine's memory, else the line that says
    so and what to change (remedies)."""
    if fits(each, ranks_here, memory):
        return ""
    return (f"{config} offloads {each / 1e9:,.1f} GB a rank to the host (the memory plan), "
            f"{each * ranks_here / 1e9:,.1f} GB for the {ranks_here} rank(s) on {socket.gethostname()}, more than "
            f"the {USABLE_HOST * memory / 1e9:,.1f} GB its memory gives them ({memory / 1e9:,.1f} GB): "
            f"{remedies(ranks_here, weights, adapters, stage3)}")


def remedies(ranks_here: int, weights: bool, adapters: bool, stage3: bool) -> str:
    """What frees host memory for a run that offloads too much there: weights, whether the weights are among what it
    offloads (offload_param); adapters: LoRA would help (a transformers model that trains all its weights); stage3:
    ZeRO-3, which alone can offload to NVMe."""
    ways = ["run fewer ranks a machine, on more machines"] if ranks_here > 1 else []
    ways += ["offload the optimizer alone (no offload_param)"] if weights else []
    ways += ['offload to NVMe ("device": "nvme")'] if stage3 else []
    ways += ["train LoRA adapters (--lora)"] if adapters else []
    return f"{''.join(way + ', ' for way in ways)}{'or ' if ways else ''}use a machine with more memory"
