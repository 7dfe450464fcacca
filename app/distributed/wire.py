"""What the app's processes send each other, and where they listen for it.

Messages are JSON, never pickles: the rendezvous store and gloo's sockets have no authentication, so whoever
reaches their ports could otherwise run code on every rank. torch's store serves every interface of rank 0's
machine (0.0.0.0 and ::) whatever MASTER_ADDR says; open_store() binds it to MASTER_ADDR's address instead
where that is an IP address of this machine. What else listens, and the firewalling a cluster needs: docs/trust.md.
"""
import datetime
import errno
import ipaddress
import json
import socket

import torch.distributed as torch_dist

from app.errors import UserError


def encode(value) -> bytes:
    """value (JSON-able) as the bytes another rank decodes."""
    return json.dumps(value).encode("utf-8")


def decode(raw: bytes, where: str):
    """The JSON value another rank sent; one line naming where it came from when it is not JSON (nothing runs)."""
    try:
        return json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise UserError(f"{where} holds a value this run's ranks did not write (not JSON, so it was not read): "
                        f"something else reached the run's ports; firewall them (docs/trust.md)") from None


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


def open_store(addr: str, port: int, world_size: int, serve: bool, timeout: datetime.timedelta):
    """The start-up rendezvous store at addr:port: served by this process when serve (rank 0), bound to addr
    when that is an IP address of this machine; else torch's default, every interface, which rank 0 says."""
    sock, local = _bound_socket(addr, port) if serve else (None, True)
    if sock is None:  # multi-tenant: a store this process already serves on the port is reused
        store = torch_dist.TCPStore(addr, port, world_size, serve, timeout, wait_for_workers=False, multi_tenant=True)
        if not local:
            print(f"note: rank 0's rendezvous store listens on port {store.port} of every interface of this machine "
                  f"(MASTER_ADDR {addr} is not an IP address of it); firewall that port (docs/trust.md)",
                  flush=True)
        return store
    return torch_dist.TCPStore(addr, port, world_size, True, timeout, wait_for_workers=False, multi_tenant=True,
                         master_listen_fd=sock.detach())  # the store's server owns the descriptor from here
