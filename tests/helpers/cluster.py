"""A real cluster on loopback addresses of this machine: Debian packages, an sshd, a one-node Slurm.

127.0.0.1 and 127.0.0.2 act as two hosts reached through one sshd on a non-default port; 127.0.0.3
has nothing listening and so is a host that is down. Nothing listens beyond 127.0.0.0/8.
"""
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, free_port

HOSTS = ("127.0.0.1", "127.0.0.2")
TWO_HOSTS = REPO / "hostfiles" / "two-loopback-hosts"  # the documented example holds HOSTS, one slot each
DOWN_HOST = "127.0.0.3"


def require_packages():
    """When a package the cluster needs is missing: skip, saying the command that installs it, for a user who
    cannot install it; fail as root, for whom `make test` installs them (as in CI)."""
    done = subprocess.run(["bash", str(REPO / "scripts" / "cluster-packages.sh"), "--check"], capture_output=True,
                          text=True)
    if done.returncode:
        (pytest.fail if os.geteuid() == 0 else pytest.skip)(f"the multi-node tests {done.stderr.strip()}")


def wait_for(ready, what, timeout=30):
    """Poll ready() until it is true; fail the test naming what never came up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.1)
    pytest.fail(f"{what} did not come up within {timeout} s")


def port_open(host, port) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def start(cmd, log: Path) -> subprocess.Popen:
    """A daemon kept in the foreground, so that stopping it is ours to do."""
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(processes):
    """Stop the daemons and reap them."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def keygen(path: Path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


class Cluster:
    """The running pieces and the environment a launch on them needs."""

    def __init__(self, root: Path):
        self.root, self.processes = root, []
        self.bin = root / "bin"
        self.ssh_port = free_port()

    def start_sshd(self):
        """One sshd on HOSTS with its own host key, accepting our generated user key only."""
        for name in ("host_key", "id_key"):
            keygen(self.root / name)
        shutil.copy(self.root / "id_key.pub", self.root / "authorized_keys")
        listen = "".join(f"ListenAddress {host}\n" for host in HOSTS)
        (self.root / "sshd_config").write_text(
            f"Port {self.ssh_port}\n{listen}HostKey {self.root}/host_key\nAuthorizedKeysFile {self.root}/authorized_keys\n"
            f"PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            f"UsePAM no\nStrictModes no\nPidFile {self.root}/sshd.pid\n")
        # what a user's ~/.ssh/config says; an `ssh` first on PATH hands it to pdsh, mpirun and the doctor alike
        (self.root / "ssh_config").write_text(
            f"Host 127.0.0.*\n  Port {self.ssh_port}\n  IdentityFile {self.root}/id_key\n"
            f"  UserKnownHostsFile {self.root}/known_hosts\n  StrictHostKeyChecking accept-new\n"
            f"  BatchMode yes\n  ConnectTimeout 5\n  LogLevel ERROR\n")
        self.bin.mkdir()
        (self.bin / "ssh").write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {self.root}/ssh_config "$@"\n')
        (self.bin / "ssh").chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        self.processes.append(start(["/usr/sbin/sshd", "-D", "-e", "-f", str(self.root / "sshd_config")],
                                    self.root / "sshd.log"))
        for host in HOSTS:
            wait_for(lambda: port_open(host, self.ssh_port), f"sshd on {host}:{self.ssh_port}")

    def start_slurm(self):
        """munged, slurmctld and slurmd of a one-node cluster, every file and port its own."""
        root = self.root / "slurm"
        for sub in ("state", "spool"):
            (root / sub).mkdir(parents=True)
        subprocess.run(["mungekey", "-c", "-k", str(root / "munge.key")], check=True)
        self.processes.append(start(["/usr/sbin/munged", "-F", "--force", f"--key-file={root}/munge.key",
                                     f"--socket={root}/munge.sock", f"--pid-file={root}/munged.pid",
                                     f"--seed-file={root}/munge.seed", f"--log-file={root}/munged.log"],
                                    root / "munged.out"))
        wait_for(lambda: (root / "munge.sock").exists(), "munged")
        (root / "slurm.conf").write_text(
            f"ClusterName=apptest\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={free_port()}\n"
            f"SlurmdPort={free_port()}\nSlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\n"
            f"AuthInfo=socket={root}/munge.sock\nCredType=cred/munge\nStateSaveLocation={root}/state\n"
            f"SlurmdSpoolDir={root}/spool\nSlurmctldPidFile={root}/slurmctld.pid\nSlurmdPidFile={root}/slurmd.pid\n"
            f"ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nMpiDefault=none\nReturnToService=2\n"
            f"SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nSlurmdParameters=config_overrides\n"
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN\n"
            f"PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP\n")
        self.slurm_conf = root / "slurm.conf"
        self.processes.append(start(["/usr/sbin/slurmctld", "-D", "-i", "-f", str(self.slurm_conf)],
                                    root / "slurmctld.log"))
        self.processes.append(start(["/usr/sbin/slurmd", "-D", "-N", "localhost", "-f", str(self.slurm_conf)],
                                    root / "slurmd.log"))
        env = {**os.environ, "SLURM_CONF": str(self.slurm_conf)}
        wait_for(lambda: subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                                        env=env).stdout.strip() == "idle", "the one-node Slurm")

    def hostfile(self, *hosts, slots=1) -> Path:
        """A DeepSpeed hostfile of hosts, slots each."""
        path = self.root / ("hosts-" + "-".join(hosts))
        path.write_text("".join(f"{host} slots={slots}\n" for host in hosts))
        return path

    def env(self, **extra) -> dict:
        """What a launch on this cluster needs in its environment (the rest is the test's own)."""
        # .deepspeed_env: DeepSpeed hands its lines to every node; DS_ENV_FILE points it at ours
        ds_env = self.root / f"deepspeed_env-{len(list(self.root.glob('deepspeed_env-*')))}"
        ds_env.write_text("".join(f"{key}={value}\n" for key, value in
                                  {"HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu",
                                   **extra.pop("deepspeed_env", {})}.items()))
        env = {"PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}", "DS_ENV_FILE": str(ds_env),
               # mpirun refuses root unless told; the tests run as root in CI
               "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        if getattr(self, "slurm_conf", None):
            env["SLURM_CONF"] = str(self.slurm_conf)
        return {**env, **extra}


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """The packages installed once, one sshd on HOSTS and a one-node Slurm, stopped at the end of the session."""
    require_packages()
    found = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        found.start_sshd()
        found.start_slurm()
        yield found
    finally:
        stop(found.processes)
