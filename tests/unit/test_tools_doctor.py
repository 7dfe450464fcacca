"""The pre-flight doctor's checks that need no host: a missing hostfile, the example hostfiles, a host name ssh
would read as an option. Against a real sshd: tests/e2e/test_tools_doctor.py."""
import json

import pytest

from app.errors import UserError
from app.tools import doctor
from helpers.cluster import HOSTS  # noqa: F401 (a fixture)
from conftest import REPO, free_port


def rows_of(output) -> dict:
    """(check, where) -> status from the doctor's table."""
    rows = {}
    for line in output.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 3 and parts[2] in ("ok", "FAIL"):
            rows[(parts[0], parts[1])] = parts[2]
        elif len(parts) >= 4 and parts[3] in ("ok", "FAIL"):  # "master port", "port reach"
            rows[(f"{parts[0]} {parts[1]}", parts[2])] = parts[3]
    return rows


def test_a_missing_hostfile_fails(tmp_path, capsys):
    code = doctor.main(["--hostfile", str(tmp_path / "nope"), "--master_port", str(free_port())])
    out = capsys.readouterr().out
    assert code == 1 and "not found" in out and rows_of(out)[("hostfile", str(tmp_path / "nope"))] == "FAIL"


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "hostfiles").iterdir()))
def test_example_hostfiles_parse(name):
    args = doctor.build_parser().parse_args(["--hostfile", str(REPO / "hostfiles" / name)])
    hosts = doctor.read_hosts(args)
    assert hosts and all(slots >= 1 for slots in hosts.values())
    if name == "two-loopback-hosts":
        assert tuple(hosts) == HOSTS and set(hosts.values()) == {1}


def test_a_host_name_that_ssh_would_read_as_an_option_fails(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"-oProxyCommand=touch${{IFS}}{tmp_path}/ran slots=1\n127.0.0.1 slots=1\n")
    code = doctor.main(["--hostfile", str(hostfile), "--master_port", str(free_port())])
    out = capsys.readouterr().out
    assert code == 1 and "begins with '-', which ssh reads as an option" in out
    assert rows_of(out)[("hostfile", str(hostfile))] == "FAIL" and not (tmp_path / "ran").exists()


@pytest.mark.parametrize("text, bad", [("NCCL_DEBUG=INFO\n# MASTER_ADDR=10.0.0.1\n", "line 2: '# MASTER_ADDR=10.0.0.1'"),
                                       ("NCCL_DEBUG=INFO\n\n", "line 2: ''"), ("NCCL_DEBUG=INFO\n", "")])
def test_a_deepspeed_env_line_the_launcher_would_misread_fails(text, bad, tmp_path, monkeypatch):
    """DeepSpeed's runner exports each line as written: a '#' comments out the rest of pdsh's line, so the nodes
    start nothing and the launch exits 0; a blank line ends it in a traceback."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    (tmp_path / ".deepspeed_env").write_text(text)
    rows = []
    doctor.shell_rows(lambda *row: rows.append(row), doctor.build_parser().parse_args(["--output_dir", "runs/a"]))
    said = {check: status for check, _, status, *_ in rows}
    assert said["env file"].startswith(f"./.deepspeed_env {bad} is not NAME=value" if bad else ""), said["env file"]
    assert ("the nodes start nothing" in said["env file"]) == bool(bad)


def test_the_config_is_checked_on_its_data_parallel_ranks_as_a_run_checks_it(tmp_path):
    """DeepSpeed's global batch is micro x accumulation x data-parallel ranks: tensor parallelism over 2 of 4 slots
    leaves 2. A size that does not divide the slots is the run's own line."""
    assert doctor.check_config(REPO / "ds_configs" / "tensor_parallel.json", 4) == \
        "micro batch 32 x accumulation 1 x 2 data-parallel rank(s) of 4 = global batch 64"
    fixed = json.loads((REPO / "ds_configs" / "tensor_parallel.json").read_text())
    fixed["train_batch_size"] = 64
    (tmp_path / "tp64.json").write_text(json.dumps(fixed))
    assert doctor.check_config(tmp_path / "tp64.json", 4).endswith("= global batch 64")
    with pytest.raises(UserError, match="autotp_size 2 does not divide the world size 3"):
        doctor.check_config(REPO / "ds_configs" / "tensor_parallel.json", 3)
    assert doctor.check_config(REPO / "ds_configs" / "dp.json", 2) == \
        "micro batch 32 x accumulation 1 x 2 data-parallel rank(s) = global batch 64"


def test_without_a_hostfile_the_slots_are_what_deepspeeds_runner_counts(monkeypatch):
    """DeepSpeed's runner starts a rank per accelerator device: on a CPU, per NUMA node or LOCAL_SIZE (not the
    number of CUDA devices, 0 here)."""
    from deepspeed.accelerator import get_accelerator
    assert get_accelerator().device_name() == "cpu"  # the unit tests pin themselves to the CPU
    monkeypatch.setenv("LOCAL_SIZE", "2")
    args = doctor.build_parser().parse_args([])
    assert doctor.read_hosts(args) == {"localhost": 2}
