"""The pre-flight doctor against a real sshd on loopback hosts: a good set-up passes, each fault fails its row."""
import json
import socket

import pytest

from app.tools import doctor
from cluster import DOWN_HOST, HOSTS, TWO_HOSTS, cluster  # noqa: F401 (a fixture)
from conftest import BIN, REPO, free_port, run


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


def doctor_in_process(cluster, monkeypatch, capsys, *args):
    """(exit code, table) of app.tools.doctor run here, with the cluster's ssh on PATH."""
    for key, value in cluster.env().items():
        monkeypatch.setenv(key, value)
    code = doctor.main([str(a) for a in args])
    return code, capsys.readouterr().out


@pytest.mark.slow
def test_good_set_up_passes(cluster, tmp_path):
    """Every host answers over ssh with the same Python and packages, and reaches the master port."""
    port = free_port()
    result = run([str(BIN / "python"), "-m", "app.tools.doctor", "--hostfile", TWO_HOSTS, "--master_port",
                  str(port), "--output_dir", tmp_path / "run"], timeout=120, **cluster.env())
    assert result.returncode == 0, result.stdout + result.stderr
    rows = rows_of(result.stdout)
    for host in HOSTS:
        for check in ("ssh", "versions", "port reach"):
            assert rows[(check, host)] == "ok", result.stdout
    assert rows[("master port", f"{HOSTS[0]}:{port}")] == "ok"
    assert rows[("shell", "pdsh")] == rows[("secrets", "pdsh")] == "ok"
    assert ("config", str(REPO / "ds_configs" / "dp.json")) in rows and "global batch 64" in result.stdout
    assert "all checks passed" in result.stdout


@pytest.mark.slow
def test_a_host_that_is_down_is_named(cluster, monkeypatch, capsys):
    code, out = doctor_in_process(cluster, monkeypatch, capsys, "--hostfile", cluster.hostfile(*HOSTS, DOWN_HOST),
                                  "--master_port", free_port())
    rows = rows_of(out)
    assert code == 1
    assert rows[("ssh", DOWN_HOST)] == "FAIL" and "Connection refused" in out
    assert all(rows[("ssh", host)] == "ok" for host in HOSTS), "DeepSpeed checks only the first; we check each"
    assert out.splitlines()[-1] == f"1 check(s) failed: ssh {DOWN_HOST}"


@pytest.mark.slow
def test_a_busy_master_port_fails(cluster, monkeypatch, capsys):
    with socket.socket() as busy:
        busy.bind((HOSTS[0], 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out = doctor_in_process(cluster, monkeypatch, capsys, "--hostfile", TWO_HOSTS,
                                      "--master_port", port)
    assert code == 1
    assert rows_of(out)[("master port", f"{HOSTS[0]}:{port}")] == "FAIL"
    assert "pass a free --master_port" in out


@pytest.mark.slow
@pytest.mark.parametrize("text, expected", [
    ('{"train_micro_batch_size_per_gpu": 4,,}', "not valid JSON"),
    (json.dumps({"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1,
                "train_batch_size": 48}), "x world size 2 = 64"),
])
def test_a_bad_config_fails(text, expected, cluster, monkeypatch, capsys, tmp_path):
    """A config that cannot run on the hostfile's total slots fails before any node is touched."""
    config = tmp_path / "bad.json"
    config.write_text(text)
    code, out = doctor_in_process(cluster, monkeypatch, capsys, "--deepspeed_config", config, "--hostfile",
                                  TWO_HOSTS, "--master_port", free_port())
    assert code == 1
    assert rows_of(out)[("config", str(config))] == "FAIL" and expected in out
    assert out.splitlines()[-1] == f"1 check(s) failed: config {config}"


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


@pytest.mark.slow
def test_shell_code_in_a_flag_and_a_secret_on_pdshs_command_line_fail(cluster, monkeypatch, capsys, tmp_path):
    """Before any launch: the flags as DeepSpeed's pdsh runner would write them hold `$(...)`, and a token would
    ride on its command line (the launch itself would run the one and show the other)."""
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-5e1d")
    code, out = doctor_in_process(cluster, monkeypatch, capsys, "--hostfile", TWO_HOSTS, "--master_port",
                                  free_port(), "--", "--dataset", f"data $(touch {tmp_path}/ran)")
    rows = rows_of(out)
    assert code == 1 and rows[("shell", "pdsh")] == "FAIL" and rows[("secrets", "pdsh")] == "FAIL", out
    assert "'$('" in out and "MLFLOW_TRACKING_TOKEN travels" in out and not (tmp_path / "ran").exists()
