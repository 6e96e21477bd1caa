"""StoreCalls on real TCPStores: bounded calls against a stopped server, close()."""

from __future__ import annotations

import datetime
import gc
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from shm_broadcast.errors import ClosedError, CommTimeout
from shm_broadcast.ranks.store_calls import StoreCalls
from shm_broadcast.ranks.tcp_store import client_store, master_store
from tests.child_env import child_env

SERVER = """
import datetime, sys, time
from shm_broadcast.ranks.tcp_store import master_store
s = master_store("127.0.0.1", 0, None, datetime.timedelta(seconds=60))
print(s.port, flush=True)
sys.stdin.readline()
"""


def _calls(store: dist.Store) -> StoreCalls:
    return StoreCalls(store, "test store", "the test's server", [0], queue_name="t")


@pytest.mark.timeout(90)
def test_a_call_abandoned_before_it_was_sent_never_reaches_the_store() -> None:
    env = child_env()
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(server.stdout.readline())
        calls = _calls(client_store("127.0.0.1", port, None, datetime.timedelta(seconds=30)))
        calls.call("set", "ready", b"1", limit=10, op="setup", side="client")
        os.kill(server.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(CommTimeout) as running:  # sent: stuck in the server's silence
            calls.call("wait", ["never"], datetime.timedelta(seconds=0.5), limit=1.0,
                       op="first", side="client")
        with pytest.raises(CommTimeout) as queued:  # queued behind it: dropped unsent
            calls.call("set", "late", b"x", limit=0.3, op="second", side="client")
        assert time.monotonic() - t0 < 1.3 + 1.0
        assert "never sent" not in str(running.value), str(running.value)
        assert "never sent" in str(queued.value) and "op second" in str(queued.value)
        assert list(running.value.peers) == [0] and running.value.queue == "t"
        os.kill(server.pid, signal.SIGCONT)
        assert calls.call("check", ["ready"], limit=30, op="after", side="client")
        assert not calls.call("check", ["late"], limit=30, op="after", side="client"), \
            "a set that timed out before it was sent reached the store"
        calls.close()
        with pytest.raises(ClosedError, match="test store is closed"):
            calls.call("check", ["ready"], limit=1, op="closed", side="client")
        server.communicate("bye\n", timeout=30)
    finally:
        server.kill()  # SIGKILL ends a stopped process too
        server.wait(10)


def test_close_releases_the_store_so_its_server_stops_listening() -> None:
    master = master_store("127.0.0.1", 0, None, datetime.timedelta(seconds=10))
    port = master.port
    calls = _calls(master)
    calls.call("set", "k", b"v", limit=10, op="set", side="server")
    calls.close()
    del master
    gc.collect()
    deadline = time.monotonic() + 10
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                break  # refused: nobody listens any more
        assert time.monotonic() < deadline, "the store kept listening after close()"
        time.sleep(0.05)


@pytest.mark.parametrize("limit", [0, -1.0, float("nan"), "1"])
def test_a_bad_limit_is_refused(limit: object) -> None:
    calls = _calls(dist.HashStore())  # refused before any request
    try:
        with pytest.raises(ValueError, match="limit must be a positive number"):
            calls.call("check", ["k"], limit=limit, op="check", side="server")  # type: ignore[arg-type]
    finally:
        calls.close()
