"""W&B's quiet search for a login key: found in the environment or the .netrc `wandb login` writes, not found in a
home without one, and in neither case a word printed (the 'logged in' line asks W&B's server through its service,
which a process that cannot reach the server waits for at exit) or the user's W&B settings written."""
import json
import os
import subprocess
import sys

from conftest import REPO

SEARCH = '''
import json, os, wandb
from app.ds import internals
found = []
for env in ({}, {"WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567"}):
    os.environ.update(env)
    found.append(internals.wandb_key_found(wandb))
    for name in env:
        del os.environ[name]
print(json.dumps(found))
'''


def test_the_key_is_found_where_wandb_init_would_find_it_and_nothing_is_said_or_written(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "NETRC"))}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "config"), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", SEARCH], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [False, True]
    assert "logged in" not in done.stderr and "API key is configured" not in done.stderr, done.stderr
    assert not (tmp_path / "config" / "settings").exists(), "the user's W&B settings are left as they were"
    import wandb
    from urllib.parse import urlparse
    host = urlparse(wandb.Settings().base_url).hostname  # the server W&B logs in to, as `wandb login` writes it
    (tmp_path / ".netrc").write_text(f"machine {host} login user password {'f' * 40}\n")
    (tmp_path / ".netrc").chmod(0o600)
    again = subprocess.run([sys.executable, "-c", SEARCH], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env=env, stdin=subprocess.DEVNULL)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1]) == [True, True], "the .netrc's key, then the variable's"
