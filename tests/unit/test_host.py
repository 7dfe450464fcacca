"""The host's side of the memory plan: the memory a machine gives a run (its RAM, or its cgroup's limit), and the
check that the states a config offloads fit it for the machine's ranks."""
import socket

from app.memory import estimate, host


def cgroups(tmp_path, membership: str, limits: dict):
    """A /proc/self/cgroup file and a cgroup tree under tmp_path, with limits {relative file: text}."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "cgroup").write_text(membership)
    for name, text in limits.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text + "\n")
    return str(tmp_path / "cgroup"), tmp_path / "fs"


def test_a_cgroup_v2_limit_is_the_tightest_of_the_process_group_and_its_ancestors(tmp_path):
    proc, root = cgroups(tmp_path, "0::/slurm/job_7/step_0\n", {"slurm/job_7/memory.max": "8589934592",
                                                                 "slurm/job_7/step_0/memory.max": "max"})
    assert host.cgroup_limit(proc, root) == 8 * 2**30


def test_a_cgroup_v1_memory_limit_is_read_and_no_limit_is_none(tmp_path):
    proc, root = cgroups(tmp_path, "5:cpu,cpuacct:/x\n4:memory:/docker/abc\n",
                         {"memory/docker/abc/memory.limit_in_bytes": "4294967296",
                          "memory/memory.limit_in_bytes": "9223372036854771712", "cpu/x/memory.max": "1"})
    assert host.cgroup_limit(proc, root) == 4 * 2**30, "the memory controller's, not the cpu one's"
    proc, root = cgroups(tmp_path / "none", "4:memory:/\n0::/\n", {"memory/memory.limit_in_bytes":
                                                                     "9223372036854771712", "memory.max": "max"})
    assert host.cgroup_limit(proc, root) == 0
    assert host.cgroup_limit(str(tmp_path / "absent"), root) == 0


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
