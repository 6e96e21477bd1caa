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
from tests.processes import stop_process

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
        stop_process(server.pid)
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


_EXITING_CLIENT = """
import atexit, datetime, sys
from shm_broadcast.errors import CommTimeout
from shm_broadcast.ranks.store_calls import StoreCalls
from shm_broadcast.ranks.tcp_store import client_store
from tests.processes import stop_process
port, server = int(sys.argv[1]), int(sys.argv[2])
calls = StoreCalls(client_store("127.0.0.1", port, None, datetime.timedelta(seconds=30)),
                   "test store", "the test's server", [0])
calls.call("set", "ready", b"1", limit=10, op="setup", side="client")
stop_process(server)
try:
    calls.call("get", "ready", limit=0.3, op="stuck", side="client")
    sys.exit("the stopped server answered")
except CommTimeout:
    pass
atexit.register(print, "exiting", flush=True)  # the last handler registered runs first
sys.exit(3)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("delay", [0.03, 0.1], ids=["30ms", "100ms"])
def test_a_call_answered_while_the_process_exits_does_not_abort_it(delay: float) -> None:
    """A call given up on while the server was stopped is answered while its process
    exits (the server resumes ``delay`` after the client started to exit): the exit
    waits for that answer instead of letting the worker return from C++ into a
    finalised interpreter, which aborts the process ("terminate called without an
    active exception"; at 30 ms the unfixed client aborted 6 times in 6)."""
    env = child_env()
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    client = None
    try:
        port = server.stdout.readline().strip()
        client = subprocess.Popen([sys.executable, "-c", _EXITING_CLIENT, port, str(server.pid)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env)
        for line in client.stdout:
            if line.strip() == "exiting":
                time.sleep(delay)
                break
        os.kill(server.pid, signal.SIGCONT)
        out, err = client.communicate(timeout=60)
        assert client.returncode == 3, (client.returncode, err[-2000:])
        assert "terminate called" not in err, err[-2000:]
    finally:
        if client is not None and client.poll() is None:
            client.kill()
            client.wait(10)
        server.kill()
        server.wait(10)
