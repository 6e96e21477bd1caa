"""Store servers listen where they are told, and nowhere else (no traffic leaves loopback)."""

from __future__ import annotations

import datetime

import psutil
import pytest

from shm_broadcast.ranks.launcher import free_port
from shm_broadcast.ranks.tcp_store import client_store, master_store

_T = datetime.timedelta(seconds=10)


def listening_on(port: int) -> set[str]:
    """Local addresses of this process's TCP sockets listening on ``port``."""
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@pytest.mark.parametrize("port", ["free", "zero"])
def test_master_store_listens_on_loopback_only(port: str) -> None:
    store = master_store("127.0.0.1", free_port() if port == "free" else 0, 2, _T)
    try:
        assert listening_on(store.port) == {"127.0.0.1"}
        client = client_store("127.0.0.1", store.port, 2, _T)
        client.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        del store


def test_localhost_listens_on_loopback_only() -> None:
    store = master_store("localhost", 0, 1, _T)
    try:
        got = listening_on(store.port)
        assert got and all(ip in ("127.0.0.1", "::1") for ip in got), got
    finally:
        del store


def test_a_host_name_listens_on_every_interface() -> None:
    """A node's own name may resolve to a loopback address on the node and to
    its network address elsewhere: binding it here could shut other nodes out."""
    import socket

    store = master_store(socket.gethostname(), 0, 1, _T)
    try:
        assert listening_on(store.port) - {"127.0.0.1", "::1"}, listening_on(store.port)
    finally:
        del store


def test_torch_alone_would_listen_on_every_interface() -> None:
    """Why the module exists: the same request made to torch directly."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=_T)
    try:
        assert listening_on(store.port) - {"127.0.0.1"}, listening_on(store.port)
    finally:
        del store


def test_a_taken_port_is_an_os_error() -> None:
    store = master_store("127.0.0.1", 0, 1, _T)
    try:
        with pytest.raises(OSError):
            master_store("127.0.0.1", store.port, 1, _T)
    finally:
        del store


def test_a_loopback_name_of_a_host_only_store_listens_on_loopback() -> None:
    """``loopback_only`` (a group whose ranks are all here): a name that resolves to
    loopback addresses here listens on those, not on every interface."""
    import socket

    from shm_broadcast.ranks.host_address import is_loopback_host

    name = next((n for n in (socket.gethostname(), "localhost") if is_loopback_host(n)), None)
    if name is None:
        pytest.skip("no name of this host resolves to loopback only")
    store = master_store(name, 0, 1, _T, loopback_only=True)
    try:
        listening = listening_on(store.port)
        assert listening and listening <= {"127.0.0.1", "::1", "127.0.1.1"}, listening
    finally:
        del store


_SILENT_SERVER = """
import datetime, socket, sys, time
from shm_broadcast.errors import CommTimeout
from shm_broadcast.ranks.tcp_store import client_store
server = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
t0 = time.monotonic()
try:
    client_store("127.0.0.1", server.getsockname()[1], 2, datetime.timedelta(seconds=1))
except CommTimeout:
    print(f"timed out {time.monotonic() - t0:.2f}", flush=True)
{end}
sys.exit(3)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["", "server.close()"], ids=["server-open", "server-closed"])
def test_a_silent_server_times_out_and_the_process_exits_cleanly(end: str) -> None:
    """torch's client constructor waits without limit for an accepted connection's
    answer; given up on, it must be over before the interpreter ends (a C++ call
    returning into a finalised interpreter aborts the process)."""
    import subprocess
    import sys

    from tests.child_env import child_env

    proc = subprocess.run([sys.executable, "-c", _SILENT_SERVER.replace("{end}", end)],
                          capture_output=True, text=True, timeout=50, env=child_env())
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-2000:])
    assert "terminate called" not in proc.stderr
    waited = float(proc.stdout.split()[-1])
    # timeout + grace, plus what a loaded 2-core machine adds (8.4 s seen): bounded,
    # where the unfixed wait never returns
    assert 1.0 <= waited < 1.0 + 2 * 2.0 + 15.0, proc.stdout


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["other_port", "udp", "unix", "unbound"])
def test_a_listen_socket_that_is_not_a_tcp_socket_on_port_is_refused(kind: str) -> None:
    """The store listens on the caller's socket while clients connect to ``port``:
    a socket on another port left rank 0 listening where nobody connects (the others
    timed out); a UDP socket gave torch's DistNetworkError."""
    import socket

    port = free_port()
    if kind == "other_port":
        sock = socket.create_server(("127.0.0.1", 0))
    elif kind == "udp":
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", port))
    elif kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        sock = socket.socket()
    try:
        with pytest.raises(ValueError, match="listen_socket") as err:
            master_store("127.0.0.1", port, 2, _T, listen_socket=sock)
        assert str(port) in str(err.value), err.value
    finally:
        sock.close()
    assert not listening_on(port)


def test_a_listen_socket_on_port_serves_clients() -> None:
    import socket

    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    try:
        store = master_store("127.0.0.1", port, 2, _T, listen_socket=sock)
        client = client_store("127.0.0.1", port, 2, _T)
        client.set("k", b"v")
        assert store.get("k") == b"v"
        del client, store
    finally:
        sock.close()


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return False
    return True


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_a_bracketed_ipv6_address_is_served_and_reached(host: str) -> None:
    """``[::1]`` (the URL form) bound ``::1`` but went to torch and the clients as
    written, and no client could ever connect."""
    store = master_store(host, 0, 2, _T)
    try:
        assert listening_on(store.port) == {"::1"}
        client = client_store(host, store.port, 2, datetime.timedelta(seconds=3))
        client.set("k", b"v")
        assert store.get("k") == b"v"
        del client
    finally:
        del store


@pytest.mark.parametrize("host", ["[localhost]", "[127.0.0.1]", "[::1"])
def test_brackets_around_anything_but_an_ipv6_address_are_refused(host: str) -> None:
    with pytest.raises(ValueError, match="host"):
        master_store(host, 0, 1, _T)
    with pytest.raises(ValueError, match="host"):
        client_store(host, free_port(), 1, datetime.timedelta(seconds=1))


@pytest.mark.timeout(60)
def test_giving_up_on_one_store_leaves_a_store_on_another_host_at_the_same_port() -> None:
    """A client that times out shuts the sockets it opened to its silent server; it
    shut every socket of the process to that port number, so a healthy client of a
    store on another host (here 127.0.0.2) at the same port broke with it."""
    import socket
    import threading

    from shm_broadcast.errors import CommTimeout

    port = free_port()
    silent = socket.create_server(("127.0.0.1", port))  # accepts, never answers
    live = master_store("127.0.0.2", port, None, _T)
    outcome: dict[str, str] = {}

    def gives_up() -> None:
        try:
            client_store("127.0.0.1", port, None, datetime.timedelta(seconds=2))
        except CommTimeout:
            outcome["silent"] = "CommTimeout"

    waiter = threading.Thread(target=gives_up)
    waiter.start()
    try:
        other = client_store("127.0.0.2", port, None, _T)  # opened during the other's wait
        other.set("k", b"before")
        waiter.join(30)
        assert outcome == {"silent": "CommTimeout"}
        assert other.get("k") == b"before"  # still connected
    finally:
        waiter.join(30)
        silent.close()
        del live
