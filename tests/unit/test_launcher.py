"""DeepSpeed's launcher and start-up as the app meets them (app/ds/internals/launcher.py): shm, logs, CPU, devices."""
import io
import os
import re
import time

import pytest

from app.ds.internals import launcher


def test_a_process_the_deepspeed_launcher_did_not_start_sees_no_hostfile_pdsh_nor_node_shell_line():
    assert launcher.launcher_world_info() == {}
    assert launcher.started_by_pdsh() is False
    assert launcher.node_shell_line() is None


def _deepspeeds_segment_name(addr: str, port: str, rank: int) -> str:
    """The name DeepSpeed's CPU comm op gives a rank's segment, by the format strings of its C++ source (shm.cpp)."""
    import deepspeed
    with open(os.path.join(os.path.dirname(deepspeed.__file__), "ops", "csrc", "cpu", "comm", "shm.cpp")) as source:
        text = source.read()
    base = re.search(r'#define SHM_BUFFER_NAME "(\w+)"', text).group(1)
    prefix = re.search(r'"(%s_%d_%s_%s)",\s*SHM_BUFFER_NAME,\s*getuid\(\),\s*addr_string,\s*port_string',
                       text).group(1)
    assert 'snprintf(shm_name, NAME_BUF_SIZE, "%s_%d", shm_name_prefix, rank)' in text
    return "/dev/shm/" + "%s_%d" % (prefix % (base, os.getuid(), addr, port), rank)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
def test_the_ranks_shared_memory_segment_loses_its_name_and_the_other_ranks_keep_theirs(monkeypatch):
    """DeepSpeed never removes them: a name that drifted from DeepSpeed's would leave 69 MB a rank in /dev/shm after
    every run."""
    port = f"unit{os.getpid()}"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    names = [_deepspeeds_segment_name("127.0.0.1", port, rank) for rank in (0, 1)]
    try:
        for name in names:
            open(name, "w").close()
        launcher.drop_shm_names(1)
        launcher.drop_shm_names(1)  # already gone: nothing to say
        assert [os.path.exists(name) for name in names] == [True, False]
    finally:
        for name in names:
            if os.path.exists(name):
                os.unlink(name)


@pytest.fixture
def deepspeed_output(monkeypatch):
    """What DeepSpeed's own log handler writes, from a logger left as it was found afterwards."""
    from deepspeed.utils import logger
    monkeypatch.delenv("APP_DEEPSPEED_LOG", raising=False)
    handler = logger.handlers[0]
    level, filters, stream = logger.level, list(logger.filters), handler.setStream(io.StringIO())
    handler_level = handler.level
    try:
        yield lambda: handler.stream.getvalue()
    finally:
        handler.setStream(stream)
        handler.setLevel(handler_level)
        logger.setLevel(level)
        logger.filters[:] = filters


def _log_each_kind():
    from deepspeed.utils import logger
    logger.info("an info line")
    logger.warning("a warning a user should read")
    logger.warning("cpu_adam op built successfully")
    logger.error("an error line")


def test_rank_0_shows_deepspeeds_warnings_without_its_noise(deepspeed_output):
    launcher.quiet_deepspeed(0)
    _log_each_kind()
    assert "a warning a user should read" in deepspeed_output() and "an error line" in deepspeed_output()
    assert "built successfully" not in deepspeed_output() and "an info line" not in deepspeed_output()


def test_other_ranks_show_only_deepspeeds_errors(deepspeed_output):
    launcher.quiet_deepspeed(1)
    _log_each_kind()
    assert "an error line" in deepspeed_output() and "warning" not in deepspeed_output()


def test_app_deepspeed_log_gives_back_every_line_of_that_level_on_every_rank(deepspeed_output, monkeypatch):
    monkeypatch.setenv("APP_DEEPSPEED_LOG", "warning")
    launcher.quiet_deepspeed(1)
    _log_each_kind()
    assert "a warning a user should read" in deepspeed_output() and "built successfully" in deepspeed_output()


def test_app_deepspeed_log_info_shows_deepspeeds_info_lines_too(deepspeed_output, monkeypatch):
    """DeepSpeed's handler has a level of its own (warning): the logger's alone would let no info line through."""
    monkeypatch.setenv("APP_DEEPSPEED_LOG", "info")
    launcher.quiet_deepspeed(0)
    _log_each_kind()
    assert "an info line" in deepspeed_output() and "a warning a user should read" in deepspeed_output()


def test_an_op_that_loads_says_nothing_and_one_that_fails_shows_all_it_printed(capsys, monkeypatch):
    monkeypatch.delenv("APP_DEEPSPEED_LOG", raising=False)
    with launcher.op_loads_quiet():
        print("Loading extension module cpu_adam... built successfully")
    assert capsys.readouterr().out == ""
    with pytest.raises(RuntimeError, match="no compiler"), launcher.op_loads_quiet():
        print("Building extension module cpu_adam...")
        raise RuntimeError("no compiler")
    assert capsys.readouterr().out == "Building extension module cpu_adam...\n"
    monkeypatch.setenv("APP_DEEPSPEED_LOG", "info")
    with launcher.op_loads_quiet():
        print("built successfully")
    assert capsys.readouterr().out == "built successfully\n"


def test_the_cpu_is_read_once_per_process_and_each_caller_gets_its_own_answer():
    """py-cpuinfo starts a Python process per question (about a second); DeepSpeed asks three times per CPU
    optimizer it builds. After cpu_info_once, the second question costs nothing and returns the same answer."""
    import cpuinfo
    launcher.cpu_info_once()
    launcher.cpu_info_once()  # patched once: the cache is not wrapped in another
    first = cpuinfo.get_cpu_info()
    first["flags"].append("changed by a caller")
    started = time.perf_counter()
    second = cpuinfo.get_cpu_info()
    assert time.perf_counter() - started < 0.05, "asked again"
    assert "changed by a caller" not in second["flags"] and second["arch"] == first["arch"]
    assert second == cpuinfo.get_cpu_info()


@pytest.fixture
def cuda_accelerator():
    """DeepSpeed's CUDA accelerator (its device names need no GPU) as DeepSpeed's accelerator, for the test alone."""
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    before = get_accelerator()
    set_accelerator(CUDA_Accelerator())
    try:
        yield get_accelerator()
    finally:
        set_accelerator(before)


def test_every_device_deepspeed_names_by_number_is_the_ranks_own(cuda_accelerator):
    """Under srun --gpus-per-task=1 a rank sees its GPU as 0 whatever its LOCAL_RANK, which DeepSpeed would use."""
    launcher.pin_device(0)
    assert [cuda_accelerator.device_name(i) for i in (0, 1, 3)] == ["cuda:0"] * 3
    assert cuda_accelerator.device_name() == "cuda", "the device type alone is still asked as such"


def test_pinning_again_moves_the_pin_instead_of_stacking_it(cuda_accelerator):
    own_set_device = cuda_accelerator.set_device
    launcher.pin_device(1)
    launcher.pin_device(0)
    assert cuda_accelerator.device_name(1) == "cuda:0"
    assert cuda_accelerator.set_device.pinned_to == 0
    assert cuda_accelerator.set_device.deepspeed_original == own_set_device
