"""The benchmark's profile of a mode: torch's profiler over the steps after the measured ones, its summary line and
tables, the device's busy time counted once, the graphs torch.compile made. A mode profiled for real:
tests/e2e/test_tools_bench.py."""
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from app.tools import bench_profile
from app.tools.bench_profile import STEPS, Profile

CPU = torch.device("cpu")


def _steps(profile: Profile, count: int):
    """count steps of a few real matmuls, each ended by a tick."""
    a = torch.randn(64, 64)
    for _ in range(count):
        for _ in range(3):
            a = torch.tanh(a @ a)
        profile.tick()


def test_a_profile_ticked_past_its_window_writes_its_summary_line_and_tables(tmp_path):
    profile = Profile(CPU, after=2)
    _steps(profile, 2 + STEPS + 2)
    summary = profile.write(tmp_path / "profile-raw.txt", "raw", (3, 1))
    assert summary.startswith("profile raw: ") and " ms a step wall, device busy 0.0 ms (0%), host ops " in summary
    assert summary.endswith(" ms; 3 graphs compiled, 1 graph breaks"), "no device on a CPU: busy 0"
    text = (tmp_path / "profile-raw.txt").read_text()
    assert text.splitlines()[0] == summary
    assert "aten::mm" in text and "Self CPU" in text, "the host's table, by self CPU time"
    assert "Self CUDA" not in text, "no device table on a CPU"


def test_a_profile_whose_window_was_never_reached_says_so_and_writes_nothing(tmp_path):
    profile = Profile(CPU, after=5)
    _steps(profile, 4)
    assert profile.profiler is None
    assert profile.write(tmp_path / "profile-dp.txt", "dp", (0, 0)) == "profile dp: not reached"
    assert not (tmp_path / "profile-dp.txt").exists()


def test_the_device_is_busy_for_its_own_events_alone_not_again_for_the_op_that_launched_them():
    """On a GPU the aten op carries its kernel's time as self device time too: summed over every event, 145%."""
    op = FunctionEvent(id=1, name="aten::mm", thread=0, start_us=0, end_us=50, use_device="cuda")
    op.append_kernel("gemm", 0, 30)
    kernel = FunctionEvent(id=2, name="gemm", thread=0, start_us=10, end_us=40, use_device="cuda",
                           device_type=DeviceType.CUDA)
    copy = FunctionEvent(id=3, name="Memcpy HtoD", thread=0, start_us=40, end_us=45, use_device="cuda",
                         device_type=DeviceType.CUDA)
    assert sum(e.self_device_time_total for e in (op, kernel, copy)) == 65, "what the old sum counted"
    assert bench_profile.device_busy_us([op, kernel, copy]) == 35


def test_graphs_made_counts_the_graphs_torch_compile_makes():
    before = bench_profile.graphs_made()
    compiled = torch.compile(lambda x: torch.sin(x) + 1, backend="eager")  # eager: no C++ build, the graph counts
    compiled(torch.randn(3))
    after = bench_profile.graphs_made()
    assert after[0] == before[0] + 1 and after[1] == before[1]


def test_the_peak_table_says_the_largest_parts_of_the_peak_and_nothing_where_nothing_was_recorded():
    """On a GPU the profiled steps' allocations are recorded (torch's snapshot format); on a CPU nothing is."""
    frames = [{"filename": "/x/transformers/models/gpt2/modeling_gpt2.py", "line": 5, "name": "forward"}]
    trace = [{"action": "alloc", "addr": 1, "size": 3 * 10**9, "frames": frames},
             {"action": "free_completed", "addr": 1, "size": 3 * 10**9, "frames": []}]
    assert bench_profile.peak_table(None, 0) == ""
    assert bench_profile.peak_table({"device_traces": [[], trace]}, 10**9, device=1).splitlines() == [
        "", "allocated at the peak of the step after the profiled ones: 4.000 GB, the largest parts:",
        "     3.000 GB  forward (gpt2/modeling_gpt2.py:5)", "     1.000 GB  allocated before the recorded steps"]
