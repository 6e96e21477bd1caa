"""MonitorDrain on real CURVE sockets: an idle writer's monitors do not keep a
connection flood's events, and ``take`` still sees every event before it."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from shm_broadcast.queue.monitor_drain import MonitorDrain
from shm_broadcast.queue.transport import (
    HANDSHAKE_FAILED,
    bind,
    close_all,
    make_curve_server,
    new_keypair,
    open_monitor,
    stop_monitor,
)


def _pending(mon: zmq.SyncSocket) -> int:
    """Events waiting in a monitor's pipe (taken out to count them)."""
    n = 0
    while mon.poll(0):
        mon.recv_multipart()
        n += 1
    return n


@pytest.fixture
def curve_ports():
    """Two CURVE server sockets on loopback (as a writer's ctl and pub) with their monitors."""
    ctx = zmq.Context(io_threads=1)
    secret = new_keypair()[1]
    ctl, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.XPUB)
    mons = []
    try:
        for sock in (ctl, pub):
            sock.linger = 0
            make_curve_server(sock, secret)
        ctl_mon = open_monitor(ctl, zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        mons.append((ctl, ctl_mon))
        pub_mon = open_monitor(pub, HANDSHAKE_FAILED)
        mons.append((pub, pub_mon))
        ports = [int(bind(s, "tcp://127.0.0.1:*").rsplit(":", 1)[1]) for s in (ctl, pub)]
        yield ports, ctl_mon, pub_mon
    finally:
        for sock, mon in mons:
            stop_monitor(sock, mon)
        close_all(ctl, pub)
        ctx.term()


def _drain_threads() -> int:
    return sum(t.name == "groupcoord-monitor-drain" for t in threading.enumerate())


def _flood(ports: list[int], n: int) -> None:
    for port in ports:
        for _ in range(n):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()


def _settled(drain: MonitorDrain, want: int, limit: float = 20.0) -> tuple[int, list[int]]:
    """take() until it has counted ``want`` failed handshakes (libzmq reports them
    a little after the connections close)."""
    failed, gone = 0, []
    deadline = time.monotonic() + limit
    while failed < want and time.monotonic() < deadline:
        f, g = drain.take()
        failed, gone = failed + f, gone + g
        time.sleep(0.05)
    return failed, gone


@pytest.mark.timeout(60)
def test_an_idle_writers_monitors_are_emptied_in_the_background(curve_ports) -> None:
    """Nobody calls take() during the flood: the thread empties the monitors'
    (unbounded) pipes anyway, and the counts wait for the next take()."""
    ports, ctl_mon, pub_mon = curve_ports
    before = _drain_threads()
    drain = MonitorDrain(ctl_mon, pub_mon, period=0.05)
    assert _drain_threads() == before + 1
    try:
        _flood(ports, 150)
        deadline = time.monotonic() + 20
        while True:  # until libzmq has reported every connection and the thread took it in
            time.sleep(0.3)
            with drain.holding():
                left = _pending(ctl_mon) + _pending(pub_mon)
            if left == 0 or time.monotonic() > deadline:
                break
        assert left == 0, f"{left} events were left in the monitors' pipes"
        failed, gone = drain.take()
        assert failed >= 250, failed  # each connection's failed handshake, counted once
        assert len(gone) == len(set(gone)) and len(gone) < 250, len(gone)  # a set of fds
    finally:
        drain.stop()
    assert _drain_threads() == before  # stop() ends the thread before the sockets close


@pytest.mark.timeout(60)
def test_take_includes_what_libzmq_reported_before_it(curve_ports) -> None:
    """With the thread asleep (a long period), take() drains the sockets itself."""
    ports, ctl_mon, pub_mon = curve_ports
    drain = MonitorDrain(ctl_mon, pub_mon, period=3600)
    try:
        _flood(ports[:1], 20)
        failed, gone = _settled(drain, 20)
        assert failed == 20 and gone, (failed, gone)
        assert drain.take() == (0, [])  # counted once
    finally:
        drain.stop()
    drain.stop()  # idempotent
