"""What DeepSpeed's pdsh runner hands every node's shell, read by a real `sh`: refused pieces run there, accepted
ones arrive intact; secret-looking variables on its command line are named; secrets stay out of saved dicts."""
import json
import subprocess

import pytest

from app.ds import internals as ds_internals
from app.distributed import node_shell
from app.checkpoint.save import TrainerState
from app.errors import UserError
from app.redact import REDACTED, looks_secret, redacted


def through_node_shell(arg: str, cwd) -> list:
    """The words a node's shell makes of arg as DeepSpeed's pdsh runner writes it into the line."""
    line = "printf '%s\\n' " + " ".join(ds_internals.pdsh_words([arg]))
    return subprocess.run(["sh", "-c", line], cwd=cwd, capture_output=True, text=True).stdout.splitlines()


@pytest.mark.parametrize("arg", ["runs/a", "runs/with space", "data/x.txt", "--lr=1e-3", 'say "hi" twice',
                                 "hf:org/model@main", "50%,a+b", "a;b |c&d"])
def test_what_is_accepted_reaches_the_rank_intact(arg, tmp_path):
    node_shell.check_arguments([arg], str(tmp_path))
    assert through_node_shell(arg, tmp_path) == [arg]


@pytest.mark.parametrize("arg", ["runs/$(touch ran)", "runs/a;touch\tran", "runs/`touch ran`", "a b $(touch ran)",
                                 'x \\"; touch ran; \\"', "runs/a|touch\tran", "runs/a&&touch\tran"])
def test_what_is_refused_would_run_in_the_node_shell(arg, tmp_path):
    with pytest.raises(UserError, match="every node's shell, where it would run or expand"):
        node_shell.check_arguments(["--output_dir", arg], str(tmp_path))
    through_node_shell(arg, tmp_path)
    assert (tmp_path / "ran").exists()  # the refusal was needed: the shell ran it


@pytest.mark.parametrize("cwd", ["/tmp/a b", "/tmp/a$(id)", "/tmp/a;b"])
def test_a_launch_folder_the_shell_would_split_or_run_is_refused(cwd):
    with pytest.raises(UserError, match="launch directory"):
        node_shell.check_arguments(["--max_steps", "2"], cwd)


def test_a_host_that_ssh_reads_as_an_option_is_refused():
    node_shell.check_hosts(["127.0.0.1", "node-0"], "hosts")
    with pytest.raises(UserError, match="begins with '-'"):
        node_shell.check_hosts(["127.0.0.1", "-oProxyCommand=x"], "hosts")


@pytest.mark.parametrize("name, secret", [("MLFLOW_TRACKING_TOKEN", True), ("HF_TOKEN", True), ("api_key", True),
                                          ("WANDB_API_KEY", True), ("MLFLOW_TRACKING_PASSWORD", True),
                                          ("AWS_SECRET_ACCESS_KEY", True), ("NCCL_IB_PKEY", False),
                                          ("TOKENIZERS_PARALLELISM", False), ("PYTHONPATH", False)])
def test_names_that_look_like_secrets(name, secret):
    assert looks_secret(name) == secret


def test_secret_looking_variables_that_pdsh_would_carry_are_named(tmp_path):
    """Set ones the runner exports by prefix, and .deepspeed_env lines (read as DeepSpeed reads them)."""
    (tmp_path / ".deepspeed_env").write_text("HF_TOKEN=hf_x\nTOKENIZERS_PARALLELISM=false\n")
    env = {"MLFLOW_TRACKING_TOKEN": "t", "PYTHONPATH": "/x", "OTHER_TOKEN": "not exported"}
    exported = ds_internals.pdsh_exports(env, str(tmp_path))
    assert ("HF_TOKEN", str(tmp_path / ".deepspeed_env")) in exported
    line = node_shell.secrets_warning(name for name, _ in exported)
    assert line.startswith("warning: HF_TOKEN, MLFLOW_TRACKING_TOKEN travel ") and "OTHER_TOKEN" not in line
    assert node_shell.secrets_warning(["PYTHONPATH", "NCCL_IB_PKEY"]) == ""


def test_a_url_with_a_password_in_an_exported_variable_is_a_secret(monkeypatch):
    """MLflow's tracking URI of a database store holds its password (user:password@host)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://alice:s3cr3t@db.internal/mlflow")
    assert node_shell.secrets_warning(["MLFLOW_TRACKING_URI"]).startswith("warning: MLFLOW_TRACKING_URI travels ")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://db.internal:5000")
    assert node_shell.secrets_warning(["MLFLOW_TRACKING_URI"]) == ""


def test_trainer_state_is_written_without_the_monitors_key():
    ds = {"train_micro_batch_size_per_gpu": 2, "comet": {"enabled": False, "api_key": "abc123", "project": "p"}}
    state = TrainerState(1, 0, 0, "mlp", "d", 1, 0, {}, {}, ds)
    written = json.loads(state.to_json())
    assert written["deepspeed_config"]["comet"] == {"enabled": False, "api_key": REDACTED, "project": "p"}
    assert state.deepspeed_config["comet"]["api_key"] == "abc123"  # what the engine was given is untouched
    assert redacted({"api_key": None, "n": [{"token": "x"}]}) == {"api_key": None, "n": [{"token": REDACTED}]}
