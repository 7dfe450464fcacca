"""What the ranks send each other (JSON, else one line and nothing runs) and where a one-rank store listens."""
import datetime
import os
import pickle

import psutil
import pytest
import torch.distributed as torch_dist

from app.distributed import wire
from app.errors import UserError
from conftest import free_port

TIMEOUT = datetime.timedelta(seconds=10)


class _Payload:
    """What whoever reaches a store's port could write there: a pickle that creates a file when loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _listening(port: int) -> set:
    return {c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN
            and c.laddr.port == port}


@pytest.mark.parametrize("value", [["memory", "CUDA out of memory"], "rank 1: --lr must be positive", 7, None,
                                   {"step": 3, "losses": [1.5, float("inf")]}, ["", ""], "ünïcödé ✓"])
def test_a_json_value_arrives_as_it_was_sent(value):
    assert wire.decode(wire.encode(value), "x") == value


def test_a_tuple_arrives_as_a_list_and_any_buffer_is_read():
    raw = wire.encode(("error", "why"))
    assert wire.decode(raw, "x") == ["error", "why"]
    assert wire.decode(bytearray(raw), "x") == wire.decode(memoryview(raw), "x") == ["error", "why"]


def test_a_pickle_from_the_network_is_refused_in_one_line_and_runs_nothing(tmp_path):
    marker = tmp_path / "the-pickle-ran"
    with pytest.raises(UserError) as caught:
        wire.decode(pickle.dumps(_Payload(marker)), "the rendezvous store's key app/run0/alone")
    message = str(caught.value)
    assert message.startswith("the rendezvous store's key app/run0/alone holds a value this run's ranks did not "
                              "write (not JSON of what they write, so it was not read)")
    assert "firewall them (docs/trust.md)" in message and "\n" not in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__, "no traceback of the parser"
    assert not marker.exists()


@pytest.mark.parametrize("raw", [b"", b"\xff\xfe\x00", b"{'single': 'quotes'}", b"[1, 2"])
def test_bytes_that_are_not_json_name_where_they_came_from(raw):
    with pytest.raises(UserError, match="^a message from rank 3 holds a value this run's ranks did not write"):
        wire.decode(raw, "a message from rank 3")


def test_only_an_ip_address_of_this_machine_is_bound_and_a_port_in_use_is_said_so():
    port = free_port()
    assert wire._bound_socket("localhost", port) == (None, False), "a host name stays torch's: every interface"
    assert wire._bound_socket("192.0.2.1", port) == (None, False), "not an address of this machine"
    sock, local = wire._bound_socket("127.0.0.1", port)
    try:
        assert local and sock.getsockname() == ("127.0.0.1", port)
        assert _listening(port) == {"127.0.0.1"}
        assert wire._bound_socket("127.0.0.1", port) == (None, True), "in use: torch's store reuses it or says so"
    finally:
        sock.close()


def test_a_run_of_one_rank_serves_its_store_on_master_addr_alone():
    port = free_port()
    store = wire.open_store("127.0.0.1", port, 1, True, TIMEOUT)
    assert _listening(port) == {"127.0.0.1"}, "not every interface of the machine"
    store.set("node/0", wire.encode(["host-a", 0]))
    client = torch_dist.TCPStore("127.0.0.1", port, 1, False, TIMEOUT)
    assert wire.decode(client.get("node/0"), "x") == ["host-a", 0]


def test_a_second_run_in_the_same_process_reuses_the_store_it_serves():
    """Several jobs in one launch (tests/helpers/jobs.py) meet at the same port: the store is shared, not refused."""
    port = free_port()
    first = wire.open_store("127.0.0.1", port, 1, True, TIMEOUT)
    second = wire.open_store("127.0.0.1", port, 1, True, TIMEOUT)
    first.set("verdict", "")
    assert second.get("verdict") == b""
    assert _listening(port) == {"127.0.0.1"}


def test_a_host_name_leaves_the_store_on_every_interface():
    port = free_port()
    store = wire.open_store("localhost", port, 1, True, TIMEOUT)
    assert _listening(port) and _listening(port) <= {"0.0.0.0", "::"}, _listening(port)
    store.set("k", "v")


@pytest.mark.parametrize("raw", [b"5", b'"host"', b'{"a": 1}'])
def test_json_of_another_kind_than_the_ranks_write_is_one_line(raw):
    """A rank's node is a list (host, ...): a number or a text where it should be, from something else on the
    network, ends the run in the same line, not in a TypeError."""
    with pytest.raises(UserError, match="^the rendezvous store's key node/1 holds a value this run's ranks did not"):
        wire.decode(raw, "the rendezvous store's key node/1", list)
    assert wire.decode(b'["h", 3]', "x", list) == ["h", 3]
