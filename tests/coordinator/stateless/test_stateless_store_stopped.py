"""A StatelessProcessGroup whose store host is stopped (SIGSTOP) raises in time, then
recovers; one whose store host died raises at the next write.

A TCPStore client waits for its server's answer without limit; these tests
stop the process of rank 0 (which serves the store), check that every
blocking call of rank 1 raises ``CommTimeout`` within its timeout plus the
group's answer grace, and that once rank 0 runs again (SIGCONT) rank 1's group
carries on: what it sends arrives, and it receives what rank 0 sends.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from coordinator import StatelessProcessGroup
from coordinator.errors import CommTimeout, StoreConnectionError
from coordinator.testing import free_port
from shm_broadcast.ranks.launcher import start_process
from tests.processes import stop_process

SECRET = b"stopped-store-test-secret-000000"
TIMEOUT = 2.0
GRACE = 0.5  # stateless_group._ANSWER_GRACE_S

class _Host:
    """Rank 0 in a process of its own (a fork of the fork server, which imported
    torch once: a ``python -c`` host imported it again, ~2.5 s of CPU): what it
    says comes through a queue, and it leaves when told (:meth:`bye`)."""

    def __init__(self, target: Callable[..., None], port: int) -> None:
        ctx = mp.get_context("spawn")
        self._out, self._bye = ctx.Queue(), ctx.Event()
        self.proc = start_process(target, (port, SECRET, self._out, self._bye),
                                  name="gc-store-host")
        self.pid = self.proc.pid

    def said(self, timeout: float = 60.0) -> tuple[Any, ...]:
        """The next thing rank 0 says (it must say something within ``timeout``)."""
        try:
            return self._out.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"rank 0 said nothing within {timeout} s "
                                 f"(exit code {self.proc.exitcode})") from None

    def bye(self) -> int | None:
        """Let it leave; its exit code."""
        self._bye.set()
        self.proc.join(30)
        return self.proc.exitcode

    def kill(self) -> None:
        """SIGKILL (which ends a stopped process too) and reap it. Idempotent."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self._out.close()
        self._out.join_thread()


def _rank0(port: int, secret: bytes, out: Any, bye: Any) -> None:
    """Serve the store, say it is ready, receive one object from rank 1, send two
    replies, and stay until the test says it is done."""
    g = StatelessProcessGroup.create("127.0.0.1", port, 0, 2, timeout=60, secret=secret)
    out.put(("created",))
    g.barrier()
    out.put(("ready",))
    out.put(("got", g.recv_obj(1)))
    g.send_obj("r0", 1)
    g.send_obj("r1", 1)
    bye.wait(60)
    g.close()


OPS: dict[str, Callable[[StatelessProcessGroup], Any]] = {
    "recv_obj": lambda g: g.recv_obj(0),
    "broadcast_obj": lambda g: g.broadcast_obj(None, src=0),
    "all_gather_obj": lambda g: g.all_gather_obj(1),
    "barrier": lambda g: g.barrier(),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("op", [pytest.param(op, marks=[pytest.mark.slow] if op in (
    "broadcast_obj", "all_gather_obj", "barrier") else []) for op in OPS])
def test_a_stopped_store_host_times_out_and_the_group_recovers(op: str) -> None:
    port = free_port()
    host = _Host(_rank0, port)
    g = None
    try:
        assert host.said() == ("created",)  # its store listens
        g = StatelessProcessGroup.create("127.0.0.1", port, 1, 2, timeout=TIMEOUT, secret=SECRET)
        g.barrier(timeout=60)
        assert host.said() == ("ready",)
        stop_process(host.pid)
        t0 = time.monotonic()
        with pytest.raises(CommTimeout) as err:
            OPS[op](g)
        elapsed = time.monotonic() - t0
        assert elapsed < TIMEOUT + GRACE + 2.0, f"{op} took {elapsed:.1f}s"  # + a loaded machine
        msg = str(err.value)
        assert f"op {op}" in msg and "rank 1/2" in msg and f"127.0.0.1:{port}" in msg, msg
        assert "did not answer" in msg and list(err.value.peers) == [0], msg

        os.kill(host.pid, signal.SIGCONT)
        g.send_obj("after", 0)
        assert host.said() == ("got", "after")
        # A timed-out recv_obj used up the first message's number, as it does
        # when a live peer is late.
        assert g.recv_obj(0, timeout=30) == ("r1" if op == "recv_obj" else "r0")
        assert host.bye() == 0
    finally:
        if g is not None:
            g.close()
        host.kill()  # after a failure above, rank 0 may still wait for rank 1


def _rank0_create(port: int, secret: bytes, out: Any, bye: Any) -> None:
    """Make the group, say so, then meet rank 1 in a barrier."""
    g = StatelessProcessGroup.create("127.0.0.1", port, 0, 2, timeout=60, secret=secret)
    out.put(("created",))
    g.barrier()
    out.put(("met",))
    g.close()


@pytest.mark.timeout(90)
def test_create_against_a_stopped_store_host_times_out_then_succeeds() -> None:
    """The kernel accepts the connection of a stopped server, whose answer never comes."""
    port = free_port()
    host = _Host(_rank0_create, port)
    try:
        assert host.said() == ("created",)
        stop_process(host.pid)
        t0 = time.monotonic()
        with pytest.raises(CommTimeout) as err:
            StatelessProcessGroup.create("127.0.0.1", port, 1, 2, timeout=TIMEOUT, secret=SECRET)
        elapsed = time.monotonic() - t0
        # the timeout, plus CONNECT_GRACE_S, plus slack for load
        assert elapsed < TIMEOUT + 2.0 + 2.0, f"create took {elapsed:.1f}s"
        assert "op create" in str(err.value) and f"127.0.0.1:{port}" in str(err.value)
        os.kill(host.pid, signal.SIGCONT)
        g = StatelessProcessGroup.create("127.0.0.1", port, 1, 2, timeout=30, secret=SECRET)
        g.barrier()
        g.close()
        assert host.said() == ("met",)
        assert host.bye() == 0
    finally:
        host.kill()  # SIGKILL ends a stopped process too


@pytest.mark.timeout(90)
@pytest.mark.parametrize("op", ["send_obj", pytest.param("broadcast_obj_from_self",
                                                         marks=pytest.mark.slow)])
def test_a_write_after_the_store_host_died_raises_instead_of_returning(op: str) -> None:
    """A TCPStore ``set`` has no answer: without a confirming round trip the first
    write after rank 0 died returned as if stored."""
    port = free_port()
    host = _Host(_rank0_create, port)
    g = None
    try:
        assert host.said() == ("created",)
        g = StatelessProcessGroup.create("127.0.0.1", port, 1, 2, timeout=TIMEOUT, secret=SECRET)
        g.barrier(timeout=60)
        host.proc.kill()
        host.proc.join(10)
        for _ in range(2):  # the first write after the death, and the next
            with pytest.raises(StoreConnectionError) as err:
                if op == "send_obj":
                    g.send_obj("lost", 0)
                else:
                    g.broadcast_obj("lost", src=1)
            assert list(err.value.peers) == [0] and "rank 0" in str(err.value)
    finally:
        if g is not None:
            g.close()
        host.kill()


@pytest.mark.timeout(90)
def test_a_send_that_timed_out_may_still_be_delivered() -> None:
    """send_obj's value goes out before its confirmation is awaited: when the
    confirmation times out (store host stopped), the value can still land once the
    host runs again. The docstring said nothing was sent and the call could be
    repeated, which delivered the value twice."""
    port = free_port()
    host = _Host(_rank0, port)
    g = None
    try:
        assert host.said() == ("created",)
        g = StatelessProcessGroup.create("127.0.0.1", port, 1, 2, timeout=TIMEOUT, secret=SECRET)
        g.barrier(timeout=60)
        assert host.said() == ("ready",)
        stop_process(host.pid)
        with pytest.raises(CommTimeout):
            g.send_obj("timed out", 0)
        os.kill(host.pid, signal.SIGCONT)
        assert host.said() == ("got", "timed out")
        doc = " ".join((StatelessProcessGroup.send_obj.__doc__ or "").split())
        assert "may have been delivered" in doc and "do not repeat" in doc.lower(), doc
        host.bye()
    finally:
        if g is not None:
            g.close()
        host.kill()
