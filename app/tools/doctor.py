"""Pre-flight checks for a (multi-node) launch, reported in one table; exit 0 only when all pass.

    python -m app.tools.doctor --deepspeed_config ds_configs/zero2.json --hostfile hostfiles/two-loopback-hosts \
        -- <the training flags>
"""
import argparse
import concurrent.futures
import contextlib
import inspect
import json
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from app.ds import auto as ds_auto
from app.ds import config as ds_config
from app.ds import internals as ds_internals
from app.distributed import launch
from app.distributed import node_shell
from app.errors import UserError

# What each launcher runs: binaries needed where the launch starts, and on every node.
LAUNCHERS = {"pdsh": (("pdsh", "ssh"), ()), "openmpi": (("mpirun", "ompi_info", "ssh"), ("orted",)),
             "slurm": (("srun", "sbatch"), ())}
MIN_FREE_BYTES = 1 << 30
SSH_TIMEOUT_S = 10


def probe(binaries, packages, master_addr, master_port) -> dict:
    """This Python's version, the packages' versions, which binaries are on PATH, and whether the master port answers.

    Runs here and, sent as source over ssh, on every node; so it imports only the standard library.
    """
    import importlib.metadata
    import shutil
    import socket
    import sys
    versions = {}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    reach = ""
    try:
        socket.create_connection((master_addr, master_port), timeout=5).close()
    except OSError as e:
        reach = str(e)
    return {"python": sys.version.split()[0], "packages": versions, "reach": reach,
            "missing": [b for b in binaries if not shutil.which(b)]}


def _probe_over_ssh(host, ssh_port, args) -> tuple:
    """(probe result or None, the reason ssh failed) for one host, run with this same Python's path there."""
    code = f"{inspect.getsource(probe)}\nimport json\nprint(json.dumps(probe(*{args!r})))"
    port = ["-p", str(ssh_port)] if ssh_port else []
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_TIMEOUT_S}", *port, "--", host,  # a host, never an option
           shlex.join([sys.executable, "-c", code])]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=SSH_TIMEOUT_S + 20)
    except subprocess.TimeoutExpired:
        return None, f"no answer within {SSH_TIMEOUT_S + 20} s"
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1]), ""
    said = [line for line in done.stderr.strip().splitlines() if line.strip()]
    if done.returncode == 127:
        return None, f"{sys.executable} not found there: every node needs the same venv at the same path"
    return None, said[-1] if said else f"ssh exited with {done.returncode}"


def read_hosts(args) -> dict:
    """{host: slot count} the launch would use: DeepSpeed's own hostfile parsing and filters."""
    from deepspeed.launcher import runner
    from deepspeed.utils import logger
    if not args.hostfile:  # as DeepSpeed's runner counts this machine: its accelerator's devices (on a CPU, its
        from deepspeed.accelerator import get_accelerator  # NUMA nodes, or LOCAL_SIZE)
        return {"localhost": args.num_gpus if args.num_gpus > 0 else max(1, get_accelerator().device_count())}
    if not Path(args.hostfile).is_file():
        raise UserError(f"hostfile {args.hostfile} {'is a folder' if Path(args.hostfile).is_dir() else 'not found'}")
    logger.setLevel(logging.CRITICAL)  # its parser logs the whole file before raising; the row says it
    try:
        pool = runner.fetch_hostfile(args.hostfile)
        active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
        active = runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    except ValueError as e:
        raise UserError(f"{args.hostfile}: {e}") from None
    node_shell.check_hosts(pool, args.hostfile)  # ssh and pdsh would read such a host as an option
    return {host: len(slots) for host, slots in active.items()}


def package_names() -> list:
    """The packages in requirements.txt, whose versions must match on every node."""
    lines = (ds_config.REPO / "requirements.txt").read_text().splitlines()
    return [re.split(r"[=<>!~\[; ]", line.strip())[0] for line in lines if line.strip() and not line.startswith("#")]


def check_config(path, slots) -> tuple:
    """The DeepSpeed JSON: its rank layout on the total slots (pipeline, tensor and sequence parallel sizes), and
    its batch sizes against the data-parallel ranks that leaves, as a run checks them."""
    from app.parallel import layout
    ds = ds_config.load_ds_config(path)
    replicas = layout.rank_layout(ds, slots, 0, str(path)).replicas
    ds = ds_auto.fill(ds, ds_auto.Facts(), replicas)[0]  # "auto" as a run fills it
    ds = ds_config.resolve_batch_sizes(ds, replicas, path)
    ranks = f"{replicas} data-parallel rank(s)" + (f" of {slots}" if replicas != slots else "")
    if ds["train_micro_batch_size_per_gpu"] == ds_auto.AUTO:
        return (f"micro batch: the largest that runs, found at start, x accumulation x {ranks} = global "
                f"batch {ds['train_batch_size']}")
    return (f"micro batch {ds['train_micro_batch_size_per_gpu']} x accumulation {ds['gradient_accumulation_steps']}"
            f" x {ranks} = global batch {ds['train_batch_size']}")


@contextlib.contextmanager
def hold_port(addr, port):
    """Listen on the master address and port while the nodes try to reach it; yields the problem, or ''."""
    listener = socket.socket()
    # as torch's TCPStore does: a port whose last run's connections linger in TIME_WAIT is free to listen on
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((addr, port))
        listener.listen()
    except OSError as e:
        listener.close()
        yield f"cannot listen on {addr}:{port} here ({e.strerror}): pass a free --master_port, and run the " \
              f"doctor on the first host"
        return
    try:
        yield ""
    finally:
        listener.close()


def free_space(output_dir) -> tuple:
    """(free bytes, the folder measured) where the output directory is or will be."""
    path = Path(output_dir).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free, path


def run_checks(args) -> list:
    """Every check as a (check, where, ok, detail) row."""
    rows = []

    def row(check, where, problem, detail=""):
        rows.append((check, str(where), not problem, problem or detail))

    try:
        hosts = read_hosts(args)
        row("hostfile", args.hostfile or "(none: this machine)", "",
            f"{len(hosts)} host(s), {sum(hosts.values())} slot(s)")
    except UserError as e:
        hosts = {}
        row("hostfile", args.hostfile, str(e))
    try:
        row("config", args.deepspeed_config, "", check_config(args.deepspeed_config, sum(hosts.values()) or 1))
    except UserError as e:
        row("config", args.deepspeed_config, str(e))
    if args.hostfile and args.launcher == "pdsh":
        shell_rows(row, args)
    local, remote = LAUNCHERS[args.launcher] if args.hostfile else ((), ())
    missing = [b for b in local if not shutil.which(b)]
    row("launcher", "here", f"{', '.join(missing)} not found: install them (docs/multinode.md)" if missing else "",
        ", ".join(local) or "none needed")
    master_addr = args.master_addr or (next(iter(hosts), "127.0.0.1") if args.hostfile else "127.0.0.1")
    with hold_port(master_addr, args.master_port) as busy:
        row("master port", f"{master_addr}:{args.master_port}", busy, "free")
        if args.hostfile:
            probe_args = (list(remote), package_names(), master_addr, args.master_port)
            mine = probe(*probe_args)
            with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
                answers = pool.map(lambda host: _probe_over_ssh(host, args.ssh_port, probe_args), hosts)
                for host, (theirs, ssh_problem) in zip(hosts, answers):
                    row("ssh", host, ssh_problem, "reachable")
                    if theirs is not None:
                        _compare(row, host, mine, theirs, busy, master_addr, args.master_port)
    free, where = free_space(args.output_dir)
    row("disk", where, f"only {free / 2**30:.1f} GiB free" if free < MIN_FREE_BYTES else "",
        f"{free / 2**30:.1f} GiB free")
    return rows


def shell_rows(row, args):
    """What DeepSpeed's pdsh runner would hand each node's shell: the training flags and this folder as plain
    words, no secret among the variables it exports on its command line, and a .deepspeed_env it reads whole."""
    try:
        node_shell.check_arguments([args.output_dir, *args.train_args], str(Path.cwd()))
        row("shell", "pdsh", "", "flags and launch folder pass as plain words")
    except UserError as e:
        row("shell", "pdsh", str(e))
    warning = node_shell.secrets_warning(name for name, _ in ds_internals.pdsh_exports(dict(os.environ)))
    row("secrets", "pdsh", warning.removeprefix("warning: "), "no secret-looking variable on it")
    problem = ds_internals.env_file_problem(dict(os.environ))
    row("env file", "pdsh", f"{problem} is not NAME=value, which DeepSpeed's launcher makes of each line (a comment "
        f"or blank line stops the launch: the nodes start nothing); remove it" if problem else "",
        "each line of .deepspeed_env is NAME=value")


def _compare(row, host, mine, theirs, busy, master_addr, master_port):
    """Rows for one node's probe: same Python and packages as here, its binaries, and the master port."""
    differ = [f"{name} {theirs['packages'][name]} (here {version})" for name, version in mine["packages"].items()
              if theirs["packages"].get(name) != version]
    if theirs["python"] != mine["python"]:
        differ.insert(0, f"python {theirs['python']} (here {mine['python']})")
    row("versions", host, "differ: " + ", ".join(differ) if differ else "",
        f"python {theirs['python']}, {len(mine['packages'])} packages as here")
    if theirs["missing"]:
        row("launcher", host, f"{', '.join(theirs['missing'])} not found on PATH there")
    if not busy:
        row("port reach", host, f"cannot reach {master_addr}:{master_port}: {theirs['reach']}" if theirs["reach"]
            else "", f"reaches {master_addr}:{master_port}")


def format_table(rows) -> str:
    """The rows as one aligned table, failures marked FAIL."""
    table = [("check", "where", "status", "detail")] + [(c, w, "ok" if ok else "FAIL", d) for c, w, ok, d in rows]
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    return "\n".join(f"{c:<{widths[0]}}  {w:<{widths[1]}}  {s:<{widths[2]}}  {d}".rstrip() for c, w, s, d in table)


def build_parser() -> argparse.ArgumentParser:
    """The doctor's flags: the launch's own (DeepSpeed's spelling), plus where the run will write."""
    parser = argparse.ArgumentParser(prog="python -m app.tools.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", default=str(ds_config.DEFAULT_DS_CONFIG), help="the DeepSpeed JSON")
    parser.add_argument("--hostfile", default="", help="DeepSpeed hostfile (`host slots=N` lines); none: this machine")
    parser.add_argument("--include", default="", help="as deepspeed's --include")
    parser.add_argument("--exclude", default="", help="as deepspeed's --exclude")
    parser.add_argument("--num_nodes", type=int, default=-1, help="as deepspeed's --num_nodes")
    parser.add_argument("--num_gpus", type=int, default=-1, help="as deepspeed's --num_gpus")
    parser.add_argument("--master_addr", default="", help="rank 0's address (default: the first host)")
    parser.add_argument("--master_port", type=int, default=29500, help="rank 0's port (default: %(default)s)")
    parser.add_argument("--ssh_port", type=int, default=None, help="as deepspeed's --ssh_port")
    parser.add_argument("--launcher", choices=sorted(LAUNCHERS), default="pdsh", help="as deepspeed's --launcher")
    parser.add_argument("--output_dir", default="runs", help="where the run will write (default: %(default)s)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- then the training flags: checked for what the nodes' shells would run")
    return parser


def main(argv=None) -> int:
    """Run every check, print the table; 0 when all pass, 1 otherwise."""
    args = build_parser().parse_args(argv)
    args.train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    launch.prepare_environment()
    rows = run_checks(args)
    print(format_table(rows), flush=True)
    failed = [f"{check} {where}" for check, where, ok, _ in rows if not ok]
    print(f"{len(failed)} check(s) failed: {', '.join(failed)}" if failed else "all checks passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
