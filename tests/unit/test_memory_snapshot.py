"""--memory_snapshot (app/observe/memory_snapshot.py) on the CPU: where a rank's snapshot goes, that the file written
loads as memory_viz reads it, what a disk full leaves, and that nothing is recorded on the CPU, with the setting
off, or where the CUDA allocator cannot record. A real out-of-memory on a GPU, the file it writes and what
recording costs a step: scripts/oom_snapshot_check.py, the GPU check's oom_snapshot part."""
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch

from app.observe import memory_snapshot


def test_a_ranks_snapshot_goes_to_the_memory_folder_of_the_run(tmp_path):
    assert memory_snapshot.snapshot_path(tmp_path / "run", 3) == tmp_path / "run" / "memory" / "rank3.oom.pickle"
    assert memory_snapshot.snapshot_path("runs/x", 0) == Path("runs/x/memory/rank0.oom.pickle")


def test_the_file_written_is_a_pickle_with_the_segments_and_traces_memory_viz_reads(tmp_path):
    """On the CPU the allocator's snapshot is empty, but it is this torch's own, written as on a GPU."""
    path = memory_snapshot.snapshot_path(tmp_path, 0)
    assert memory_snapshot.write(path) == [str(path), ""]
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert isinstance(snapshot["segments"], list) and isinstance(snapshot["device_traces"], list)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_a_disk_full_says_the_snapshot_could_not_be_written_and_why():
    assert memory_snapshot.write(Path("/dev/full")) == ["/dev/full", "No space left on device"]
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode), "only a partial file of the snapshot's own is removed"


def test_a_folder_that_cannot_be_made_says_why_and_leaves_what_is_there(tmp_path):
    (tmp_path / "memory").write_text("the user's")
    path = memory_snapshot.snapshot_path(tmp_path, 1)
    assert memory_snapshot.write(path) == [str(path), "File exists"]
    assert (tmp_path / "memory").read_text() == "the user's"


@pytest.mark.parametrize("choice, device", [("on", torch.device("cpu")), ("off", torch.device("cuda", 0))])
def test_nothing_is_recorded_on_the_cpu_nor_with_the_setting_off(choice, device, tmp_path, capsys):
    """Asking this machine's allocator to record would fail and say so (below): these never ask."""
    with memory_snapshot.Recorder(choice, device) as recorder:
        recorder.start(tmp_path)
        assert recorder.path is None
        assert recorder.written() is None
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "memory").exists()


def test_a_cuda_allocator_that_cannot_record_leaves_the_run_going_without_snapshots_and_says_so(tmp_path, capsys):
    """This machine's CUDA build has no GPU to record on (the tests hide any): torch refuses to record, as an
    allocator that keeps no record does (backend:cudaMallocAsync)."""
    with memory_snapshot.Recorder("on", torch.device("cuda", 0)) as recorder:
        recorder.start(tmp_path)
        assert recorder.path is None and recorder.written() is None
    out = capsys.readouterr().out
    assert out.startswith("memory snapshot: off, the CUDA allocator does not record allocations here (") and \
        out.count("\n") == 1, out
    assert not (tmp_path / "memory").exists()


def _alloc(addr, size, filename, line=1, name="forward"):
    torch_file = memory_snapshot.TORCH_FOLDER + "nn/functional.py"  # on the H200, under /opt/torch/.venv/
    return {"action": "alloc", "addr": addr, "size": size, "frames": [
        {"filename": torch_file, "line": 9, "name": "linear"}, {"filename": filename, "line": line, "name": name}]}


def _free(addr, size, action="free_requested"):
    return {"action": action, "addr": addr, "size": size, "frames": []}


def test_the_peak_of_a_recorded_stretch_is_told_apart_by_the_line_that_allocated_it():
    """A trace as torch's allocator records it (device_traces, innermost frame first): 1,000 bytes held before it
    began, 200 of which the stretch frees; the peak is where the most was held, not its end; each part goes under
    its innermost frame outside torch (a model under /opt/torch/ is not torch's), and a block counts as freed when
    its free is requested, as memory_allocated counts it, not again when the free completes."""
    trace = [_alloc(1, 300, "/opt/torch/.venv/lib/site-packages/transformers/models/llama/modeling_llama.py", 40),
             _free(99, 200),  # made before recording began
             _alloc(2, 500, "/tmp/torchinductor_root/ab/cabc.py", 7, "call"),
             _alloc(3, 100, "/opt/torch/.venv/lib/site-packages/transformers/models/llama/modeling_llama.py", 40),
             _free(1, 300),
             _free(1, 300, "free_completed"),
             _alloc(4, 50, "/opt/torch/.venv/lib/site-packages/deepspeed/runtime/engine.py", 12, "allreduce")]
    peak, groups, cut = memory_snapshot.peak_composition({"device_traces": [trace], "segments": []}, before=1000)
    assert peak == 1000 - 200 + 300 + 500 + 100 and not cut  # before the free of 1: the end holds less (1,450)
    assert groups == [("allocated before the recorded steps", 800), ("call (ab/cabc.py:7)", 500),
                      ("forward (llama/modeling_llama.py:40)", 400)]
    assert memory_snapshot.peak_composition({"device_traces": [[]]}, before=70) == (
        70, [("allocated before the recorded steps", 70)], False), "nothing recorded: what was there"
    assert memory_snapshot.peak_composition({"device_traces": [trace]}, before=0, top=1)[1] == [
        ("call (ab/cabc.py:7)", 500)]
    full = [_alloc(i, 1, "/x/m.py") for i in range(memory_snapshot.MAX_ENTRIES)]
    assert memory_snapshot.peak_composition({"device_traces": [full]}, before=0)[2], "as long as recording keeps: cut"
