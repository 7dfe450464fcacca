"""What the app's processes send each other, and where they listen for it.

Messages are JSON, never pickles: the rendezvous store and gloo's sockets have no authentication, so whoever
reaches their ports could otherwise run code on every rank. torch's store serves every interface of rank 0's
machine (0.0.0.0 and ::) whatever MASTER_ADDR says; open_store() binds it to MASTER_ADDR's address instead
where that is an IP address of this machine. What else listens, and the firewalling a cluster needs: docs/trust.md.
"""
import contextlib
import ctypes
import datetime
import errno
import ipaddress
import json
import os
import select
import signal
import socket
import time

import psutil

import torch.distributed as torch_dist

from app.errors import UserError


def encode(value) -> bytes:
    """value (JSON-able) as the bytes another rank decodes."""
    return json.dumps(value).encode("utf-8")


def decode(raw: bytes, where: str, kind: type = object):
    """The JSON value another rank sent, of kind; one line naming where it came from when it is not JSON, or of
    another kind (nothing runs)."""
    try:
        found = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        found = ValueError
    if found is ValueError or not isinstance(found, kind):
        raise UserError(f"{where} holds a value this run's ranks did not write (not JSON of what they write, so it "
                        f"was not read): something else reached the run's ports; firewall them "
                        f"(docs/trust.md)") from None
    return found


def _bound_socket(addr: str, port: int) -> tuple:
    """(a listening socket on addr:port, or None; whether addr is an IP address of this machine). A host name stays
    torch's (every interface): on rank 0's node it may resolve to a loopback address the other nodes cannot use."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None, False
    sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(1024)
        return sock, True
    except OSError as e:
        sock.close()
        return None, e.errno == errno.EADDRINUSE  # in use: by this process's own store (reused), or torch says so


OUTLIVE_S = 10
"""How long rank 0's rendezvous store outlives rank 0 when it ended alone, so that the others read why there."""
STORE_NAME = "app-store"
"""The name the store's process goes by (ps -o comm, top), beside rank 0, whose command line it shares."""


def open_store(addr: str, port: int, world_size: int, serve: bool, timeout: datetime.timedelta):
    """A client of the start-up rendezvous store at addr:port. Rank 0 (serve) first starts its server, bound to
    addr when that is an IP address of this machine (else torch's default, every interface, which it says), in a
    process of its own beside it, which ends when it does (OUTLIVE_S later if it ended alone: keep_store); a run of
    one rank serves it itself."""
    if serve and world_size == 1:
        return _server(addr, port, world_size, timeout)[0]
    if serve:
        _serve_beside(addr, port, world_size, timeout)
    return torch_dist.TCPStore(addr, port, world_size, False, timeout, wait_for_workers=False)


def _server(addr: str, port: int, world_size: int, timeout: datetime.timedelta) -> tuple:
    """(the store's server at addr:port, whether it listens on addr alone)."""
    sock, local = _bound_socket(addr, port)
    if sock is None:  # multi-tenant: a store this process already serves on the port is reused
        return torch_dist.TCPStore(addr, port, world_size, True, timeout, wait_for_workers=False,
                                   multi_tenant=True), local
    return torch_dist.TCPStore(addr, port, world_size, True, timeout, wait_for_workers=False, multi_tenant=True,
                               master_listen_fd=sock.detach()), True  # the server owns the descriptor from here


def _named(name: str):
    """Give this process a name of its own (Linux: what ps -o comm and top show); elsewhere leave it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME


_store_process = []  # the process serving this rank 0's store (psutil: a signal never reaches a reused pid)


def keep_store():
    """Have rank 0's store outlive this process by OUTLIVE_S (it ends alone: the others read why there)."""
    for process in _store_process:
        with contextlib.suppress(psutil.Error, OSError):
            process.send_signal(signal.SIGUSR1)


def _serve_beside(addr: str, port: int, world_size: int, timeout: datetime.timedelta):
    """Serve the store from a process forked twice (no start-up of its own, and not a child of this one: a launcher
    that waits for a failed rank's process tree, as DeepSpeed's does, would otherwise wait until the machine's init
    reaps it), its output closed, deaf to the launcher's signals; it ends when this process does (OUTLIVE_S later
    after keep_store). Raises RuntimeError when it could not listen."""
    read, write = os.pipe()
    watch = Watch()  # this process's, taken here: the store cannot mistake another for it
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            code = 0 if os.fork() != 0 else _store_main(addr, port, world_size, timeout, watch, write)
        finally:
            os._exit(code)  # never back into the caller's code, whatever happened
    os.waitpid(pid, 0)
    watch.close()
    os.close(write)
    said = os.read(read, 1024)
    os.close(read)
    if not said or said.startswith(b"E"):
        raise RuntimeError(said[1:].decode(errors="replace") or "the store's process ended")
    with contextlib.suppress(psutil.Error):
        _store_process.append(psutil.Process(int(said[1:])))
    if said.startswith(b"A"):
        print(f"note: rank 0's rendezvous store listens on port {port} of every interface of this machine "
              f"(MASTER_ADDR {addr} is not an IP address of it); firewall that port (docs/trust.md)", flush=True)


def _store_main(addr: str, port: int, world_size: int, timeout: datetime.timedelta, watch, write: int) -> int:
    """The store's process: serve, say how (L or A, then this pid; E and why) on write, end once rank 0 has (watch);
    its exit code."""
    _named(STORE_NAME)
    kept = []
    signal.signal(signal.SIGUSR1, lambda *_: kept.append(True))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:
        store, local = _server(addr, port, world_size, timeout)
        os.write(write, (b"L" if local else b"A") + str(os.getpid()).encode())
    except Exception as e:  # noqa: BLE001 (told to the parent, which says it)
        os.write(write, b"E" + (str(e).splitlines() or [type(e).__name__])[0].encode()[:500])
        return 1
    os.close(write)
    watch.wait()
    time.sleep(OUTLIVE_S if kept else 0)
    return 0


class Watch:
    """Waits for the process that made it to end: through a pidfd where the system has them (inherited by the
    processes it forks), else polled (psutil's process, which a reused pid does not fool)."""

    def __init__(self):
        self.fd, self.process = None, psutil.Process()
        with contextlib.suppress(OSError, AttributeError):
            self.fd = os.pidfd_open(os.getpid())

    def wait(self):
        if self.fd is not None:
            waiting = select.poll()
            waiting.register(self.fd, select.POLLIN)
            waiting.poll()
            return
        with contextlib.suppress(psutil.Error):
            while self.process.is_running() and self.process.status() != psutil.STATUS_ZOMBIE:
                time.sleep(0.2)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
