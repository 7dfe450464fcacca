"""The pre-flight doctor against a real sshd on loopback hosts: a good set-up passes, each fault fails its row."""
import json
import socket

import pytest

from app.tools import doctor
from helpers.cluster import DOWN_HOST, HOSTS, TWO_HOSTS, cluster  # noqa: F401 (a fixture)
from conftest import BIN, REPO, free_port, run
from unit.test_tools_doctor import rows_of


def doctor_in_process(cluster, monkeypatch, capsys, *args):
    """(exit code, table) of app.tools.doctor run here, with the cluster's ssh on PATH."""
    for key, value in cluster.env().items():
        monkeypatch.setenv(key, value)
    code = doctor.main([str(a) for a in args])
    return code, capsys.readouterr().out


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


def test_a_host_that_is_down_is_named(cluster, monkeypatch, capsys):
    code, out = doctor_in_process(cluster, monkeypatch, capsys, "--hostfile", cluster.hostfile(*HOSTS, DOWN_HOST),
                                  "--master_port", free_port())
    rows = rows_of(out)
    assert code == 1
    assert rows[("ssh", DOWN_HOST)] == "FAIL" and "Connection refused" in out
    assert all(rows[("ssh", host)] == "ok" for host in HOSTS), "DeepSpeed checks only the first; we check each"
    assert out.splitlines()[-1] == f"1 check(s) failed: ssh {DOWN_HOST}"


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


@pytest.mark.parametrize("text, expected", [
    ('{"train_micro_batch_size_per_gpu": 4,,}', "not valid JSON"),
    (json.dumps({"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1,
                "train_batch_size": 48}), "x data-parallel ranks 2 = 64"),
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


def test_shell_code_in_a_flag_and_a_secret_on_pdshs_command_line_fail(cluster, monkeypatch, capsys, tmp_path):
    """Before any launch: the flags as DeepSpeed's pdsh runner would write them hold `$(...)`, and a token would
    ride on its command line (the launch itself would run the one and show the other)."""
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-5e1d")
    code, out = doctor_in_process(cluster, monkeypatch, capsys, "--hostfile", TWO_HOSTS, "--master_port",
                                  free_port(), "--", "--dataset", f"data $(touch {tmp_path}/ran)")
    rows = rows_of(out)
    assert code == 1 and rows[("shell", "pdsh")] == "FAIL" and rows[("secrets", "pdsh")] == "FAIL", out
    assert "'$('" in out and "MLFLOW_TRACKING_TOKEN travels" in out and not (tmp_path / "ran").exists()
