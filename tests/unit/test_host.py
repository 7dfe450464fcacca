"""The host's side of the memory plan: the memory a machine gives a run (its RAM, or its cgroup's limit), and the
check that the states a config offloads fit it for the machine's ranks."""
import socket

from app.memory import estimate, host


def cgroups(tmp_path, membership: str, limits: dict, tops: tuple = ("/", "/"), v2: str = "") -> tuple:
    """A /proc/self/cgroup file, a cgroup tree under tmp_path with limits {relative file: text}, and a
    /proc/self/mountinfo file that mounts v1's memory hierarchy at fs/memory and v2's at fs/<v2>, showing the groups
    tops (memory's, v2's) at their tops."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "cgroup").write_text(membership)
    for name, text in limits.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text + "\n")
    fs = tmp_path / "fs"
    (tmp_path / "mountinfo").write_text(
        f"25 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n31 25 0:28 / {fs} rw,nosuid - tmpfs tmpfs rw,mode=755\n"
        f"32 31 0:29 / {fs / 'cpu'} rw,relatime - cgroup cgroup rw,cpu\n"
        f"35 31 0:32 {tops[0]} {fs / 'memory'} rw,relatime - cgroup cgroup rw,memory\n"
        f"41 31 0:38 {tops[1]} {fs / v2} rw,relatime shared:9 - cgroup2 cgroup2 rw\n")
    return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")


def test_a_cgroup_v2_limit_is_the_tightest_of_the_process_group_and_its_ancestors(tmp_path):
    proc, mounts = cgroups(tmp_path, "0::/slurm/job_7/step_0\n", {"slurm/job_7/memory.max": "8589934592",
                                                                   "slurm/job_7/step_0/memory.max": "max"})
    assert host.cgroup_limit(proc, mounts) == 8 * 2**30


def test_a_cgroup_v1_memory_limit_is_read_and_no_limit_is_none(tmp_path):
    proc, mounts = cgroups(tmp_path, "5:cpu,cpuacct:/x\n4:memory:/docker/abc\n",
                           {"memory/docker/abc/memory.limit_in_bytes": "4294967296",
                            "memory/memory.limit_in_bytes": "9223372036854771712", "cpu/x/memory.max": "1"})
    assert host.cgroup_limit(proc, mounts) == 4 * 2**30, "the memory controller's, not the cpu one's"
    proc, mounts = cgroups(tmp_path / "none", "4:memory:/\n0::/\n", {"memory/memory.limit_in_bytes":
                                                                       "9223372036854771712", "memory.max": "max"})
    assert host.cgroup_limit(proc, mounts) == 0
    assert host.cgroup_limit(str(tmp_path / "absent"), mounts) == 0


def test_a_mount_that_shows_the_hierarchy_below_its_top_and_v2_mounted_aside(tmp_path):
    """A container without its own cgroup namespace: /proc/self/cgroup names the host's path, /docker/abc/job,
    while the container's mount shows /docker/abc at its top; the job's group below it has the tighter limit. v2
    mounted at unified (a hybrid machine) with a limit of its own, tighter still."""
    proc, mounts = cgroups(tmp_path, "4:memory:/docker/abc/job\n0::/docker/abc/job\n",
                           {"memory/memory.limit_in_bytes": "4294967296", "memory/job/memory.limit_in_bytes":
                            "2147483648", "memory/docker/abc/job/memory.limit_in_bytes": "1"},
                           tops=("/docker/abc", "/"))
    assert host.cgroup_limit(proc, mounts) == 2 * 2**30, "the job's group, not a path the mount does not show"
    proc, mounts = cgroups(tmp_path / "hybrid", "4:memory:/a\n0::/a\n", {"memory/a/memory.limit_in_bytes":
                                                                          "4294967296", "unified/a/memory.max":
                                                                          "1073741824", "a/memory.max": "1"},
                           v2="unified")
    assert host.cgroup_limit(proc, mounts) == 2**30


def test_without_mountinfo_the_usual_places_are_read():
    assert host.cgroup_mounts("") == {"cgroup2": ("/", host.CGROUPS), "memory": ("/", host.CGROUPS / "memory")}


def test_this_machines_memory_is_at_most_its_ram():
    assert 0 < host.host_memory() <= host.physical_memory()


def test_the_check_counts_every_rank_of_the_machine_and_says_what_to_change():
    sizes = [1000, 24]  # zero3_offload keeps 24 bytes a parameter there: fp32 weights, 2 gradients, masters, moments
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    each = host.offloaded(estimate.MemoryPlan("zero3_offload.json", 1024, *estimate.model_states(sizes, ds, 2)))
    assert each == 24 * 512
    memory = int(2 * each / host.USABLE_HOST) + 1
    assert host.fits(each, 2, memory) and host.shortfall(each, 2, memory, "zero3_offload.json", True, True) == ""
    line = host.shortfall(each, 4, memory, "zero3_offload.json", True, True)
    assert f"for the 4 rank(s) on {socket.gethostname()}, more than" in line
    assert line.endswith(": run fewer ranks a machine, on more machines, offload the optimizer alone (no offload_param), "
                         'offload to NVMe ("device": "nvme"), train LoRA adapters (--lora), or use a machine with more '
                         "memory")
    alone = host.shortfall(each, 1, each, "zero3_offload.json", False, False)
    assert alone.endswith(': offload to NVMe ("device": "nvme"), or use a machine with more memory'), \
        "one rank, no weights offloaded, LoRA already (or an image model): none of those to offer"
    zero2 = host.shortfall(each, 1, each, "zero2_offload.json", False, False, stage3=False)
    assert zero2.endswith("GB): use a machine with more memory"), "ZeRO 1-2 cannot offload to NVMe"
