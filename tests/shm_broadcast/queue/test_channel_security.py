"""Attacks on the queue's channels, replayed with real processes and sockets (loopback).

Each test plays an outsider the way issue 12 describes it and asserts that the
attack fails while the legitimate peers carry on (or raise a clear error):

* a SUB on the writer's TCP port receives nothing (CURVE + ZAP);
* a hello from an outsider does not make the writer ready;
* a forged or malformed control message on the local channel is ignored and
  counted, never a decoder's exception or a ``PeerDiedError`` for a live reader;
* after the writer dies, a process that binds its ports is never connected to:
  the reader raises ``PeerDiedError`` and decodes nothing;
* another user (``nobody``) can neither connect to nor bind in the local
  channel directory;
* the channel directory does not outlive the queue;
* a holder of a reader key cannot grow the writer: a subscription flood cuts
  its key off and ends the queue, over-long control frames end its connection,
  invalid ones beyond a small budget are dropped unparsed, and a third
  connection with its key is refused.
"""

from __future__ import annotations

import os
import pwd
import signal
import socket
import struct
import time
import traceback
from typing import Any

import msgspec
import psutil
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from shm_broadcast import MessageQueue, PeerDiedError, QueueClosedError, QueueTimeout
from shm_broadcast.queue.handle import Handle
from shm_broadcast.queue.transport import CTL_ACK, CTL_HELLO, KIND_DATA, TOPIC_REMOTE, WIRE
from shm_broadcast.waiting.peer_watch import own_pid_space

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")

_SECRET = "token ids are users' prompts"


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _hello(rank: int, pid: int | None = None) -> bytes:
    pid = os.getpid() if pid is None else pid
    ctime = psutil.Process(os.getpid()).create_time()
    return CTL_HELLO + msgspec.msgpack.encode([rank, pid, ctime, socket.gethostname(),
                                               own_pid_space()])


# ------------------------------------------------------------------ children
def legit_reader(handle: Any, rank: int, n: int, out: Any) -> None:
    """Read ``n`` messages (each must carry the secret) and report them."""
    try:
        with MessageQueue.create_from_handle(handle, rank) as mq:
            mq.wait_until_ready(60)
            got = [mq.dequeue(timeout=60) for _ in range(n)]
        assert all(g["secret"] == _SECRET for g in got), got
        out.put(("ok", rank, [g["i"] for g in got]))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def _outsider_socks(ctx: zmq.Context, handle: Any, kind: int, addr: str) -> list[zmq.Socket]:
    """Three outsiders: plain TCP, CURVE with its own key, CURVE expecting another server."""
    socks = []
    for mode in ("plain", "own-key", "wrong-server"):
        s = ctx.socket(kind)
        s.linger = 0
        if mode != "plain":
            pub, sec = zmq.curve_keypair()
            server = handle.curve_server_key if mode == "own-key" else zmq.curve_keypair()[0]
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server, pub, sec
        if kind == zmq.DEALER:
            s.setsockopt(zmq.ROUTING_ID, b"R1")
        s.connect(addr)
        socks.append(s)
    return socks


def outsider_sub(handle: Any, listen_s: float, out: Any) -> None:
    """Subscribe to everything on the writer's TCP PUB port; report what arrived."""
    try:
        ctx = zmq.Context()
        socks = _outsider_socks(ctx, handle, zmq.SUB, handle.remote_pub)
        for s in socks:
            s.subscribe(b"")
        out.put(("listening", -1))
        got = 0
        end = time.monotonic() + listen_s
        while time.monotonic() < end:
            for s in socks:
                while s.poll(0):
                    s.recv()
                    got += 1
            time.sleep(0.01)
        for s in socks:
            s.close()
        ctx.term()
        out.put(("outsider", -1, got))
    except BaseException:
        out.put(("error", -1, traceback.format_exc()))


def outsider_hello(handle: Any, out: Any) -> None:
    """Connect to the control and data ports as remote reader rank 1 would; say hello."""
    try:
        ctx = zmq.Context()
        socks = _outsider_socks(ctx, handle, zmq.DEALER, handle.remote_ctl)
        subs = _outsider_socks(ctx, handle, zmq.SUB, handle.remote_pub)
        for s in subs:
            s.subscribe(TOPIC_REMOTE)
        for s in socks:
            s.send(_hello(1))
            s.send(CTL_ACK + struct.pack("<Q", 1 << 40))
            s.send(b"h\xc1garbage")
        out.put(("sent", -1))
        time.sleep(4.0)  # stay connected while the writer waits
        for s in socks + subs:
            s.close()
        ctx.term()
        out.put(("done", -1))
    except BaseException:
        out.put(("error", -1, traceback.format_exc()))


def doomed_writer(n: int, sent: Any, out: Any) -> None:
    """A writer with one remote reader: send ``n`` messages, set ``sent``, wait to be killed.

    ``sent`` is an Event, not a report on ``out``: killing a process right
    after its report arrived can leave the shared queue's write lock held.
    """
    try:
        mq = MessageQueue(1, 0, connect_ip="127.0.0.1", name="doomed")
        out.put(("handle", 0, mq.export_handle(1)))
        mq.wait_until_ready(60)
        for i in range(n):
            mq.enqueue({"i": i, "secret": _SECRET}, timeout=60)
        sent.set()
        time.sleep(120)
    except BaseException:
        out.put(("error", 0, traceback.format_exc()))


def impostor(pub_port: int, ctl_port: int, curve: bool, seconds: float, out: Any) -> None:
    """Bind a dead writer's ports and publish well-formed frames for message #3."""
    try:
        ctx = zmq.Context()
        pub, ctl = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
        mons = []
        for s, port in ((pub, pub_port), (ctl, ctl_port)):
            s.linger = 0
            if curve:  # a CURVE server, but with a key of its own
                s.curve_server = True
                s.curve_secretkey = zmq.curve_keypair()[1]
            mons.append(s.get_monitor_socket(zmq.EVENT_ACCEPTED))
            s.bind(f"tcp://127.0.0.1:{port}")
        out.put(("bound", -2))
        body = msgspec.msgpack.encode({"i": 3, "secret": "from the impostor"})
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pub.send_multipart([TOPIC_REMOTE + WIRE.pack(3, KIND_DATA, len(body), 0) + body, b""])
            time.sleep(0.005)
        accepted = 0
        for m in mons:
            while m.poll(0):
                m.recv_multipart()
                accepted += 1
        out.put(("impostor", -2, accepted))  # before cleaning up: nothing may delay it
        for s in (pub, ctl):
            s.disable_monitor()
        for s in (*mons, pub, ctl):
            s.close(linger=0)
        ctx.term()
    except BaseException:
        out.put(("error", -2, traceback.format_exc()))


def _curve_client(ctx: zmq.Context, kind: int, handle: Any, addr: str,
                  routing_id: bytes | None = None) -> zmq.Socket:
    """A raw socket with the client keypair ``handle`` carries (a reader key's holder)."""
    s = ctx.socket(kind)
    s.linger = 0
    s.sndhwm = 0  # queue everything it is told to send: the writer must cope
    s.curve_serverkey = handle.curve_server_key
    s.curve_publickey, s.curve_secretkey = handle.curve_client_key, handle.curve_client_secret
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    s.connect(addr)
    return s


def reader_until_the_end(handle: Any, rank: int, out: Any) -> None:
    """Read until the queue ends; report how many messages came and how it ended."""
    n, why = 0, "?"
    try:
        with MessageQueue.create_from_handle(handle, rank) as mq:
            mq.wait_until_ready(60)
            out.put(("ready", rank))
            while True:
                mq.dequeue(timeout=60)
                n += 1
    except Exception as e:
        why = type(e).__name__
    out.put(("ended", rank, n, why))


def subscription_flooder(handle: Any, n: int, done: Any, out: Any) -> None:
    """With a reader's key: ``n`` distinct subscriptions on the writer's data port;
    stay connected until ``done``."""
    try:
        ctx = zmq.Context()
        s = _curve_client(ctx, zmq.XSUB, handle, handle.remote_pub)
        for i in range(n):
            s.send(b"\x01" + (b"flood-%08d" % i).ljust(48, b"."))
        out.put(("flooded", -1))
        done.wait(60)
        s.close()
        ctx.term()
    except BaseException:
        out.put(("error", -1, traceback.format_exc()))


def control_flooder(handle: Any, n: int, go: Any, out: Any) -> None:
    """With a reader's key, on the writer's control port: ``n`` small invalid
    frames, then (after ``go``) up to ``n`` frames of 60 KiB, then one more
    connection with the same key."""
    try:
        ctx = zmq.Context()
        s = _curve_client(ctx, zmq.DEALER, handle, handle.remote_ctl)
        s.setsockopt(zmq.RECONNECT_IVL, -1)
        mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        for _ in range(n):
            s.send(b"zz-garbage")
        out.put(("small-sent", -1))
        if not go.wait(60):
            raise TimeoutError("no go for the long frames")
        big, sent = b"L" * (60 << 10), 0
        for _ in range(n):
            try:
                s.send(big, zmq.NOBLOCK)
            except zmq.Again:  # the writer dropped the connection: nowhere to queue it
                break
            sent += 1
        events, end = set(), time.monotonic() + 20
        while zmq.EVENT_DISCONNECTED not in events and time.monotonic() < end:
            if mon.poll(100):
                events.add(recv_monitor_message(mon)["event"])
        third = _curve_client(ctx, zmq.DEALER, handle, handle.remote_ctl)
        third.send(b"zz-third")
        time.sleep(1.0)  # its handshake is refused by ZAP
        out.put(("big-sent", -1, sent, zmq.EVENT_DISCONNECTED in events))
        s.disable_monitor()
        for sock in (mon, s, third):
            sock.close()
        ctx.term()
    except BaseException:
        out.put(("error", -1, traceback.format_exc()))


# --------------------------------------------------------------------- tests
def _real_reader_still_gets_in(procs: Any, mq: MessageQueue, h: Any) -> None:
    """After an attack: a real reader attaches and reads three messages."""
    procs.start(legit_reader, h, 1, 3)
    mq.wait_until_ready(60)
    for i in range(3):
        mq.enqueue({"i": i, "secret": _SECRET}, timeout=30)
    assert procs.get(60)[2] == [0, 1, 2]


@pytest.mark.timeout(120)
def test_outsider_sub_on_the_tcp_port_receives_nothing(procs):
    n = 50
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1", name="sec-pub")
    try:
        h = mq.export_handle(1)
        procs.start(outsider_sub, h, 6.0)
        assert procs.get(60)[0] == "listening"
        procs.start(legit_reader, h, 1, n)
        mq.wait_until_ready(60)
        for i in range(n):
            mq.enqueue({"i": i, "secret": _SECRET}, timeout=30)
        reports = [procs.get(60) for _ in range(2)]
        stats = mq._impl.security_stats()
    finally:
        mq.close()
    by_kind = {r[0]: r for r in reports}
    assert by_kind["ok"][2] == list(range(n))  # the real reader got everything
    assert by_kind["outsider"][2] == 0  # no outsider got a single frame
    # plain TCP and a wrong server key fail the handshake; an unknown client key is refused by ZAP
    assert stats["handshake_failed"] >= 3 and stats["auth_denied"] >= 1, stats


@pytest.mark.timeout(120)
def test_outsider_hello_does_not_complete_the_handshake(procs):
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1", name="sec-hello")
    try:
        h = mq.export_handle(1)
        procs.start(outsider_hello, h)
        assert procs.get(60)[0] == "sent"
        with pytest.raises(QueueTimeout, match="1 remote reader"):
            mq.wait_until_ready(2.5)  # nothing an outsider sent counts
        stats = mq._impl.security_stats()
        assert stats["handshake_failed"] >= 4 and stats["auth_denied"] >= 2, stats
        assert procs.get(60)[0] == "done"
        _real_reader_still_gets_in(procs, mq, h)
    finally:
        mq.close()


def _silent_clients(endpoint: str, n: int) -> list[socket.socket]:
    """``n`` plain TCP connections to ``endpoint`` that never send a byte."""
    socks = []
    for _ in range(n):
        c = socket.create_connection(("127.0.0.1", _port(endpoint)), timeout=10)
        c.settimeout(0.05)
        socks.append(c)
    return socks


def _dropped(c: socket.socket) -> bool:
    """Whether the writer closed this connection (its greeting read and discarded)."""
    try:
        while c.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


@pytest.mark.timeout(120)
def test_silent_connections_are_dropped_and_do_not_hold_the_writers_descriptors(procs):
    from shm_broadcast.queue.transport import SERVE_HANDSHAKE_MS

    n = 150
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1", name="sec-silent")
    socks: list[socket.socket] = []
    try:
        h = mq.export_handle(1)
        me = psutil.Process()
        fds = me.num_fds()
        for endpoint in (h.remote_pub, h.remote_ctl):
            socks += _silent_clients(endpoint, n)
        deadline = time.monotonic() + SERVE_HANDSHAKE_MS / 1000 + 20
        while True:
            open_ = [c for c in socks if not _dropped(c)]
            if not open_ or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not open_, f"{len(open_)} of {2 * n} silent connections still open"
        # the writer's own descriptors are back (its side of each connection closed)
        assert me.num_fds() - len(socks) <= fds + 4, (me.num_fds(), len(socks), fds)
        _real_reader_still_gets_in(procs, mq, h)
    finally:
        for c in socks:
            c.close()
        mq.close()


@pytest.mark.timeout(150)
def test_thousands_of_failed_handshakes_do_not_stop_the_writer(procs):
    """Plain TCP connections that close at once, no key needed: each is a failed
    handshake the writer's socket monitors report. With libzmq's default mark
    the monitors' pipes filled after about 1,000-2,000 of them, and libzmq's I/O
    thread stopped with them: no connection accepted, nothing sent, and
    ``close()`` hung in ``disable_monitor``."""
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1", name="sec-flood")
    closed = False
    try:
        h = mq.export_handle(1)
        for endpoint, n in ((h.remote_pub, 2600), (h.remote_ctl, 1400)):
            for i in range(n):
                try:
                    socket.create_connection(("127.0.0.1", _port(endpoint)), timeout=5).close()
                except OSError as e:
                    pytest.fail(f"connection {i} to {endpoint} failed: the writer stopped "
                                f"accepting ({e})")
        _real_reader_still_gets_in(procs, mq, h)
        assert mq._impl.security_stats()["handshake_failed"] >= 3900
        start = time.monotonic()
        mq.close()
        closed = True
        assert time.monotonic() - start < 10
    finally:
        if not closed:
            mq.close()


def _dead_pid() -> int:
    p = psutil.Popen(["true"])
    p.wait()
    return p.pid


@pytest.mark.timeout(120)
def test_forged_and_malformed_local_control_messages_are_ignored(procs):
    # Same-user forger (only the owner can enter the channel directory): defence in depth.
    mq = MessageQueue(1, 1, [1], name="sec-ctl")
    ctx = zmq.Context()
    try:
        h = mq.export_handle()
        forger = ctx.socket(zmq.DEALER)
        forger.linger = 0
        forger.setsockopt(zmq.ROUTING_ID, b"L0")
        forger.connect(h.local_ctl)
        for msg in (_hello(1, pid=_dead_pid()), b"h", b"h\xc1", b"h" + msgspec.msgpack.encode(
                ["1", "x", None, 3]), _hello(1), CTL_ACK + b"\x01", b"c", b"zz"):
            forger.send(msg)
        forger.send_multipart([b"a", b"b"])
        with pytest.raises(QueueTimeout, match="local reader rank 1"):
            mq.wait_until_ready(1.5)  # no DecodeError, no PeerDiedError, not ready
        assert mq._impl.security_stats()["bad_control"] >= 9
        forger.close()
        time.sleep(0.3)  # the ROUTER frees the routing id the forger held
        procs.start(legit_reader, h, 1, 2)
        mq.wait_until_ready(60)
        for i in range(2):
            mq.enqueue({"i": i, "secret": _SECRET}, timeout=30)
        assert procs.get(60)[2] == [0, 1]
    finally:
        mq.close()
        ctx.term()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("curve", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["plain-impostor", "curve-impostor"])
def test_writer_dies_and_an_impostor_binds_its_port(procs, curve):
    sent = procs.ctx.Event()
    procs.start(doomed_writer, 3, sent)
    kind, _, h = procs.get(60)
    assert kind == "handle"
    reader = MessageQueue.create_from_handle(h, rank=1)
    try:
        reader.wait_until_ready(60)
        assert [reader.dequeue(timeout=30)["i"] for _ in range(3)] == [0, 1, 2]
        assert sent.wait(60)
        os.kill(h.writer_pid, signal.SIGKILL)
        procs.start(impostor, _port(h.remote_pub), _port(h.remote_ctl), curve, 3.0)
        assert procs.get(60)[0] == "bound"
        with pytest.raises(PeerDiedError):
            got = reader.dequeue(timeout=10)
            pytest.fail(f"decoded a frame after the writer died: {got!r}")
        report = procs.get(60)
        assert report[0] == "impostor" and report[2] == 0  # never even connected to
    finally:
        reader.close()


def _nobody() -> tuple[int, int] | None:
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        return None
    return pw.pw_uid, pw.pw_gid


def _as_nobody(uid: int, gid: int, channel_dir: str) -> int:
    """In a forked child running as ``nobody``: which local attacks succeed (bitmask)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no zmq, no Python-level cleanup, just syscalls
        os.close(r)
        mask = 0
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            attacks = [
                lambda: os.listdir(channel_dir),
                lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(
                    os.path.join(channel_dir, "c")),  # the control ROUTER
                lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(
                    os.path.join(channel_dir, "p")),  # the overflow PUB
                lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).bind(
                    os.path.join(channel_dir, "r0")),  # pre-bind a reader's doorbell
                lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(
                    b"!", os.path.join(channel_dir, "w")),  # ring the writer
            ]
            for bit, attack in enumerate(attacks):
                try:
                    attack()
                    mask |= 1 << bit
                except PermissionError:
                    pass
                except OSError:
                    mask |= 1 << (bit + 8)  # failed for another reason: report it
        except BaseException:
            mask = 1 << 16
        os.write(w, struct.pack("<i", mask))
        os._exit(0)
    os.close(w)
    try:
        data = os.read(r, 4)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return struct.unpack("<i", data)[0]


@pytest.mark.timeout(120)
def test_another_user_cannot_reach_the_local_channels(procs):
    ids = _nobody()
    if os.geteuid() != 0 or ids is None:
        pytest.skip("needs root (to become 'nobody' in a forked child) and a 'nobody' user")
    mq = MessageQueue(1, 1, [1], name="sec-local")
    try:
        h = mq.export_handle()
        channel_dir = h.bell_prefix.rstrip("/")
        st = os.stat(channel_dir)
        assert st.st_mode & 0o777 == 0o700 and st.st_uid == os.geteuid()
        assert h.local_pub == f"ipc://{channel_dir}/p" and h.local_ctl == f"ipc://{channel_dir}/c"
        assert _as_nobody(*ids, channel_dir) == 0  # every attack: PermissionError
        procs.start(legit_reader, h, 1, 2)
        mq.wait_until_ready(60)
        assert not os.path.exists(channel_dir)  # sealed: no path into the queue is left
        for i in range(2):
            mq.enqueue({"i": i, "secret": _SECRET}, timeout=30)
        assert procs.get(60)[2] == [0, 1]
    finally:
        mq.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attacker", ["world-writable", "another-user"])
def test_a_reader_refuses_a_segment_name_re_created_after_its_writer(attacker):
    """The writer left; an attacker re-creates its segment name (mode 0666, or
    owned by ``nobody``) and waits for a late reader to attach and trust it."""
    from shm_broadcast.errors import SegmentError

    ids = _nobody()
    if attacker == "another-user" and (os.geteuid() != 0 or ids is None):
        pytest.skip("needs root (to chown to 'nobody') and a 'nobody' user")
    w = MessageQueue(1, 1, [1], name="sec-hijack")
    h = w.export_handle()
    w.close()
    path = f"/dev/shm/{h.segment}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 1 << 20)
        if attacker == "another-user":
            os.fchown(fd, *ids)
        else:
            os.fchmod(fd, 0o666)
        os.close(fd)
        with pytest.raises(SegmentError, match="not private"):
            MessageQueue.create_from_handle(h, 1)
    finally:
        os.unlink(path)


@pytest.mark.parametrize("kind", ["open-mode", "symlink", "another-user"])
def test_a_channel_directory_that_is_not_private_is_refused(tmp_path, kind):
    from shm_broadcast.errors import SegmentError
    from shm_broadcast.lifecycle.channel_dirs import check_private_dir

    target = tmp_path / "gcabcdefgh"
    target.mkdir(mode=0o700)
    os.chmod(target, 0o700)
    check_private_dir(str(target))  # ours and private: fine
    if kind == "open-mode":
        os.chmod(target, 0o755)
    elif kind == "symlink":
        link = tmp_path / "gclinklink"
        link.symlink_to(target)
        target = link
    else:
        ids = _nobody()
        if os.geteuid() != 0 or ids is None:
            pytest.skip("needs root (to chown to 'nobody') and a 'nobody' user")
        os.chown(target, *ids)
    with pytest.raises(SegmentError, match="not private"):
        check_private_dir(str(target))


def _abstract_gc_sockets() -> list[str]:
    """Abstract Unix sockets named like ours (``@gc_...``) anywhere on the host."""
    with open("/proc/net/unix") as f:
        return [line.split()[-1] for line in f.read().splitlines()[1:]
                if line.split()[-1].startswith("@gc")]


@pytest.mark.timeout(120)
def test_bench_baseline_sockets_are_files_only_this_user_reaches():
    """``groupcoord bench mq``'s pickle + zmq baseline: its sockets are files in a
    private directory, not abstract names any local user could connect to (and
    push a pickle to), and they go away with the driver."""
    import multiprocessing as mp

    from shm_broadcast.bench.baselines import ZmqPickleDriver

    drv = ZmqPickleDriver(1, mp.get_context("spawn"))
    try:
        directory = drv.socket_dir
        st = os.lstat(directory)
        assert st.st_mode & 0o777 == 0o700 and st.st_uid == os.geteuid()
        assert {"p", "w"} <= set(os.listdir(directory))
        assert _abstract_gc_sockets() == []
        ids = _nobody()
        if os.geteuid() == 0 and ids is not None:
            assert _as_nobody(*ids, directory) == 0  # every attack: PermissionError
        assert len(drv.rt({"step": 1}, 3)) == 3  # the baseline still measures
    finally:
        drv.close()
    assert not os.path.exists(directory)


@pytest.mark.timeout(60)
def test_channel_directory_does_not_outlive_the_queue():
    mq = MessageQueue(2, 2, [1, 2], name="sec-dir")
    channel_dir = mq.export_handle().bell_prefix.rstrip("/")
    assert os.path.isdir(channel_dir)
    mq.close()  # never became ready: close removes it
    assert not os.path.exists(channel_dir)


def test_handle_hides_the_client_secret_and_readers_refuse_plain_tcp():
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1", name="sec-handle")
    try:
        h = mq.export_handle(1)
        assert h.curve_client_secret is not None and h.curve_client_secret.decode() not in repr(h)
        assert Handle.from_bytes(h.to_bytes()) == h
        bare = msgspec.structs.replace(h, curve_server_key=None)
        with pytest.raises(ValueError, match="CURVE"):
            MessageQueue.create_from_handle(bare, rank=1)
    finally:
        mq.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field, value", [
    ("curve_server_key", b"\x00" * 40), ("curve_client_key", b"\x00" * 40),
    ("curve_client_secret", b"~" * 40), ("remote_pub", "garbage"),
    ("remote_ctl", "tcp://127.0.0.1"), ("remote_pub", "inproc://x")])
def test_a_malformed_key_or_endpoint_in_a_handle_is_a_value_error(field: str, value: Any):
    """zmq refused these with a bare ``ZMQError: Invalid argument`` naming nothing
    (or, for another transport, the reader waited out its timeout)."""
    import threading

    mq = MessageQueue(1, 0, connect_ip="127.0.0.1", name="sec-bad-handle")
    try:
        h = msgspec.structs.replace(mq.export_handle(1), **{field: value})
        threads, fds = threading.active_count(), psutil.Process().num_fds()
        with pytest.raises(ValueError, match=field):
            MessageQueue.create_from_handle(h, rank=1)
        end = time.monotonic() + 5  # a socket zmq's I/O thread was connecting closes after
        while psutil.Process().num_fds() > fds and time.monotonic() < end:
            time.sleep(0.05)
        assert threading.active_count() == threads and psutil.Process().num_fds() == fds
    finally:
        mq.close()


@pytest.mark.timeout(60)
def test_a_reader_that_never_reached_its_writer_says_so_at_its_timeout():
    """The writer (on "another host", so its pid tells nothing) was gone before the
    reader connected: the timeout said "its connection is up"."""
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1", name="sec-gone")
    h = msgspec.structs.replace(mq.export_handle(0), writer_host="otherhost",
                                writer_pid_space="otherboot/1")
    mq.close()
    r = MessageQueue.create_from_handle(h, 0)
    try:
        with pytest.raises(QueueTimeout) as info:
            r.wait_until_ready(timeout=1.0)
    finally:
        r.close()
    assert "no connection to it was ever made" in str(info.value), info.value
    assert h.remote_pub in str(info.value) and "connection is up" not in str(info.value)


@pytest.mark.timeout(60)
def test_per_reader_keys_admit_each_reader_only_under_its_own_rank():
    # The planned mode (needs MessageQueue/process_group plumbing): every remote
    # reader brings its own keypair; only public keys reach the writer.
    from shm_broadcast.codec.message_codec import Codec
    from shm_broadcast.queue.remote_reader import RemoteReader
    from shm_broadcast.queue.transport import new_keypair
    from shm_broadcast.queue.writer import QueueWriter
    from shm_broadcast.waiting.policy import WaitPolicy

    k1, k2, k9 = new_keypair(), new_keypair(), new_keypair()
    with pytest.raises(ValueError, match="remote_reader_keys"):
        QueueWriter(name="k", n_reader=2, local_reader_ranks=(), max_chunk_bytes=1 << 16,
                    max_chunks=4, connect_ip="127.0.0.1", policy=WaitPolicy(), codec=Codec(),
                    writer_rank=0, remote_reader_keys={1: k1[0]})
    w = QueueWriter(name="k", n_reader=2, local_reader_ranks=(), max_chunk_bytes=1 << 16,
                    max_chunks=4, connect_ip="127.0.0.1", policy=WaitPolicy(), codec=Codec(),
                    writer_rank=0, remote_reader_keys={1: k1[0], 2: k2[0]})
    readers = []
    try:
        h = w.handle
        assert h.curve_client_secret is None and h.curve_client_key is None
        # rank 2's key used to claim rank 1, and an unknown key: neither counts
        readers.append(RemoteReader(h, 1, WaitPolicy(), Codec(), client_keypair=k2))
        readers.append(RemoteReader(h, 2, WaitPolicy(), Codec(), client_keypair=k9))
        with pytest.raises(QueueTimeout, match=r"remote reader rank\(s\) \[1, 2\]"):
            w.wait_until_ready(1.5)
        stats = w.security_stats()
        assert stats["bad_control"] >= 1 and stats["auth_denied"] >= 1, stats
        for r in readers:
            r.close()
        readers = [RemoteReader(h, 1, WaitPolicy(), Codec(), client_keypair=k1),
                   RemoteReader(h, 2, WaitPolicy(), Codec(), client_keypair=k2)]
        w.wait_until_ready(30)
        w.enqueue({"secret": _SECRET}, timeout=10)
        for r in readers:
            r.wait_until_ready(10)
            assert r.dequeue(10) == {"secret": _SECRET}
    finally:
        for r in readers:
            r.close()
        w.close()


def _read_one_each(w: MessageQueue, readers: list[MessageQueue]) -> None:
    w.wait_until_ready(30)
    w.enqueue({"secret": _SECRET}, timeout=10)
    for r in readers:
        r.wait_until_ready(10)
        assert r.dequeue(10) == {"secret": _SECRET}


@pytest.mark.timeout(60)
def test_each_remote_reader_gets_its_own_key_unless_the_queue_opts_in_to_share_one():
    """Issue 37: no key usable by several remote readers travels in the handle by
    default. With two remote readers ``export_handle()`` carries no secret and
    ``export_handle(r)`` a keypair for rank ``r`` alone; one shared key is an
    explicit opt-in."""
    from shm_broadcast.queue.transport import new_keypair

    readers: list[MessageQueue] = []
    with MessageQueue(2, 0, connect_ip="127.0.0.1", name="own-keys") as w:
        public, h1, h2 = w.export_handle(), w.export_handle(1), w.export_handle(2)
        assert public.curve_client_key is None and public.curve_client_secret is None
        assert (h1.curve_client_rank, h2.curve_client_rank) == (1, 2)
        assert h1.curve_client_key != h2.curve_client_key and w.export_handle(1) == h1
        with pytest.raises(ValueError, match="already made keys"):
            w.export_handle(3)  # two remote readers, both ranks taken
        with pytest.raises(ValueError, match=r"export_handle\(rank=1\)"):
            MessageQueue.create_from_handle(public, 1)
        with pytest.raises(ValueError, match="rank 2, not of rank 1"):
            MessageQueue.create_from_handle(h2, 1)
        try:
            readers = [MessageQueue.create_from_handle(h1, 1),
                       MessageQueue.create_from_handle(h2, 2)]
            _read_one_each(w, readers)
        finally:
            for r in readers:
                r.close()
    with MessageQueue(2, 1, [1], connect_ip="127.0.0.1", name="one-remote") as w:
        h = w.export_handle()  # its only other holders are local readers (this user)
        assert h.curve_client_secret is not None and h.curve_client_rank is None
        assert w.export_handle(2) == w.export_handle(1) == h
    with MessageQueue(2, 0, connect_ip="127.0.0.1", name="shared-key",
                      shared_reader_key=True) as w:
        h = w.export_handle()
        assert h.curve_client_secret is not None and h.curve_client_rank is None
        assert w.export_handle(1) == h
        try:
            readers = [MessageQueue.create_from_handle(h, r) for r in (1, 2)]
            _read_one_each(w, readers)
        finally:
            for r in readers:
                r.close()
    with pytest.raises(ValueError, match="shared_reader_key"):
        MessageQueue(1, 0, connect_ip="127.0.0.1", shared_reader_key=True,
                     remote_reader_keys={1: new_keypair()[0]})


# -m slow (a few seconds). With per-reader keys the writer counts rank 1's JOINED
# subscription only from rank 1's key, so the impostor's (over rank 2's key) cannot make
# READY go out before the real rank 1's subscription is in place.
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_reader_that_reconnects_under_an_attached_id_is_admitted():
    """rank 2's key claims rank 1 and stays connected; the real rank 1 then
    connects and is admitted. (Readers' routing ids carry a random part, so
    the two never share one; with bare ``R1`` ids the real reader relied on
    taking the id over, and a key holder could take it back the same way.)"""
    from shm_broadcast.codec.message_codec import Codec
    from shm_broadcast.queue.remote_reader import RemoteReader
    from shm_broadcast.queue.transport import new_keypair
    from shm_broadcast.queue.writer import QueueWriter
    from shm_broadcast.waiting.policy import WaitPolicy

    k1, k2 = new_keypair(), new_keypair()
    w = QueueWriter(name="h", n_reader=2, local_reader_ranks=(), max_chunk_bytes=1 << 16,
                    max_chunks=4, connect_ip="127.0.0.1", policy=WaitPolicy(), codec=Codec(),
                    writer_rank=0, remote_reader_keys={1: k1[0], 2: k2[0]})
    readers = [RemoteReader(w.handle, 1, WaitPolicy(), Codec(), client_keypair=k2)]
    try:
        with pytest.raises(QueueTimeout, match=r"remote reader rank\(s\) \[1, 2\]"):
            w.wait_until_ready(1.0)  # the impostor is attached under R1, not admitted
        assert w.security_stats()["bad_control"] >= 1
        readers += [RemoteReader(w.handle, 1, WaitPolicy(), Codec(), client_keypair=k1),
                    RemoteReader(w.handle, 2, WaitPolicy(), Codec(), client_keypair=k2)]
        w.wait_until_ready(20)
        w.enqueue({"secret": _SECRET}, timeout=10)
        for r in readers[1:]:
            r.wait_until_ready(10)
            assert r.dequeue(10) == {"secret": _SECRET}
    finally:
        for r in readers:
            r.close()
        w.close()


@pytest.mark.timeout(60)
def test_an_extra_subscription_does_not_make_the_writer_ready_early():
    """A second connection with an admitted key subscribes to the data topic, and
    rank 2 says hello before its own subscription is in place: the writer must
    wait for rank 2's subscription, not count the extra one, or its READY and
    first messages would be lost to rank 2."""
    from shm_broadcast.codec.message_codec import Codec
    from shm_broadcast.queue.remote_reader import RemoteReader
    from shm_broadcast.queue.transport import KIND_READY, joined_topic, new_keypair
    from shm_broadcast.queue.writer import QueueWriter
    from shm_broadcast.waiting.policy import WaitPolicy

    k1, k2 = new_keypair(), new_keypair()
    w = QueueWriter(name="x", n_reader=2, local_reader_ranks=(), max_chunk_bytes=1 << 16,
                    max_chunks=4, connect_ip="127.0.0.1", policy=WaitPolicy(), codec=Codec(),
                    writer_rank=0, remote_reader_keys={1: k1[0], 2: k2[0]})
    ctx = zmq.Context()

    def client(kind: int, addr: str) -> zmq.Socket:
        s = ctx.socket(kind)
        s.linger = 0
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = (
            w.handle.curve_server_key, k2[0], k2[1])
        if kind == zmq.DEALER:
            s.setsockopt(zmq.ROUTING_ID, b"R2")
        s.connect(addr)
        return s

    reader1 = RemoteReader(w.handle, 1, WaitPolicy(), Codec(), client_keypair=k1)
    extra = client(zmq.SUB, w.handle.remote_pub)
    extra.subscribe(TOPIC_REMOTE)
    hello2 = client(zmq.DEALER, w.handle.remote_ctl)
    try:
        hello2.send(_hello(2))
        with pytest.raises(QueueTimeout, match="subscriptions still in flight"):
            w.wait_until_ready(1.5)
        sub2 = client(zmq.SUB, w.handle.remote_pub)
        sub2.subscribe(TOPIC_REMOTE)
        sub2.subscribe(joined_topic(2))
        w.wait_until_ready(20)
        w.enqueue({"secret": _SECRET}, timeout=10)
        assert sub2.poll(10_000), "rank 2 must get the READY marker"
        frames = sub2.recv_multipart()
        assert WIRE.unpack_from(frames[0], 1)[1] == KIND_READY
        assert sub2.poll(10_000), "rank 2 must get the first message"
        assert WIRE.unpack_from(sub2.recv_multipart()[0], 1)[1] == KIND_DATA
        reader1.wait_until_ready(10)
        assert reader1.dequeue(10) == {"secret": _SECRET}
        sub2.close()
    finally:
        for s in (extra, hello2):
            s.close()
        reader1.close()
        w.close()
        ctx.term()


def _long_curve_command(endpoint: str, declared: int, send: int) -> tuple[int, bool]:
    """Play a client without keys: a ZMTP 3.0 greeting naming CURVE, then one
    command frame declaring ``declared`` bytes, then up to ``send`` bytes of it.
    Returns (bytes sent, whether the writer cut the connection)."""
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    try:
        s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0")
                  + b"\x00" + b"\0" * 31)
        s.recv(64)
        s.sendall(b"\x06" + struct.pack(">Q", declared))
        chunk, sent = b"A" * (1 << 20), 0
        while sent < send:
            s.sendall(chunk)
            sent += len(chunk)
        s.settimeout(2)
        try:
            return sent, s.recv(1) == b""
        except TimeoutError:
            return sent, False
    except OSError:  # reset or broken pipe: the writer dropped the connection
        return sent, True
    finally:
        s.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("port", ["data", "control"])
def test_a_client_without_keys_cannot_make_the_writer_buffer_a_long_frame(port):
    with MessageQueue(1, 0, connect_ip="127.0.0.1", name="long") as mq:
        h = mq.export_handle()
        me = psutil.Process()
        before = me.memory_info().rss
        sent, cut = _long_curve_command(h.remote_pub if port == "data" else h.remote_ctl,
                                        1 << 30, 48 << 20)
        grown = me.memory_info().rss - before
        assert cut, f"the writer kept a {sent >> 20} MiB unauthenticated frame's connection"
        assert grown < 16 << 20, f"the writer buffered {grown >> 20} MiB for a client without keys"


def _rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.timeout(120)
def test_a_subscription_flood_cuts_the_key_off_before_the_writer_grows(procs):
    """Issue 37: a holder of reader 2's key subscribes to 20,000 distinct topics
    on the data port. The writer applies none of them (counted as dropped),
    cuts the key off at its budget and ends the queue (shut down, PeerDiedError
    naming rank 2) within a window of messages; meanwhile no enqueue stalls on
    the flood and the writer's memory stays put (before, one enqueue took all
    20,000 in, the writer grew by tens of MB and the queue went on)."""
    mq = MessageQueue(2, 0, connect_ip="127.0.0.1", name="sec-subflood")
    done = procs.ctx.Event()
    try:
        for r in (1, 2):
            procs.start(reader_until_the_end, mq.export_handle(r), r)
        mq.wait_until_ready(60)
        assert sorted(procs.get(60)[:2] for _ in range(2)) == [("ready", 1), ("ready", 2)]
        for i in range(3):
            mq.enqueue({"i": i, "secret": _SECRET}, timeout=30)
        before = _rss()
        procs.start(subscription_flooder, mq.export_handle(2), 20_000, done)
        assert procs.get(60)[0] == "flooded"
        time.sleep(1.0)  # the flood is in the writer's socket buffers
        slowest = 0.0
        with pytest.raises(PeerDiedError, match="subscriptions") as info:
            for i in range(3, 60):
                t0 = time.perf_counter()
                mq.enqueue({"i": i, "secret": _SECRET}, timeout=30)
                slowest = max(slowest, time.perf_counter() - t0)
        grown = _rss() - before
        stats = mq.security_stats()
        with pytest.raises(QueueClosedError, match="shut down"):  # the queue ended
            mq.enqueue({"i": -1, "secret": _SECRET}, timeout=5)
    finally:
        done.set()
        mq.close()
    assert info.value.peers == (2,)
    assert grown < 16 << 20, f"the writer grew by {grown >> 20} MiB"
    assert slowest < 0.5, f"an enqueue took {slowest * 1e3:.0f} ms"
    assert stats["subscriptions_dropped"] >= 6, stats
    ended = sorted(procs.get(60) for _ in range(2))
    assert [e[1] for e in ended] == [1, 2] and all(e[2] >= 3 for e in ended), ended
    assert ended[0][3] in ("QueueClosedError", "ClosedError"), ended  # told, not left waiting


@pytest.mark.timeout(120)
def test_a_control_frame_flood_is_cut_by_size_and_budget(procs):
    """Issue 37: a holder of reader 2's key floods the control port with 2,000
    small invalid frames, then 60 KiB frames, then opens a third connection.
    The small ones beyond the invalid-frame budget are dropped unparsed and
    counted, the first long frame ends the connection (before, every one was
    queued in the writer), the third connection is refused, and both real
    readers keep reading throughout."""
    from shm_broadcast.queue.inbound_limits import BAD_FRAMES_PER_PEER

    n, n1, n2 = 2000, 40, 10
    mq = MessageQueue(2, 0, connect_ip="127.0.0.1", name="sec-ctlflood")
    try:
        for r in (1, 2):
            procs.start(legit_reader, mq.export_handle(r), r, n1 + n2)
        mq.wait_until_ready(60)
        go = procs.ctx.Event()
        procs.start(control_flooder, mq.export_handle(2), n, go)
        assert procs.get(60)[0] == "small-sent"
        for i in range(n1):
            mq.enqueue({"i": i, "secret": _SECRET}, timeout=30)
        end = time.monotonic() + 30
        stats = mq.security_stats()
        while stats["bad_control"] + stats["control_dropped"] < n and time.monotonic() < end:
            time.sleep(0.05)
            stats = mq.security_stats()
        assert stats["bad_control"] == BAD_FRAMES_PER_PEER, stats
        assert stats["control_dropped"] == n - BAD_FRAMES_PER_PEER, stats
        before = _rss()
        go.set()
        kind, _, sent, cut = procs.get(60)
        assert kind == "big-sent" and cut, (sent, cut)
        grown = _rss() - before
        assert grown < 16 << 20, f"the writer grew by {grown >> 20} MiB ({sent} long frames)"
        for i in range(n1, n1 + n2):
            mq.enqueue({"i": i, "secret": _SECRET}, timeout=30)
        reports = sorted(procs.get(60) for _ in range(2))
        assert reports == [("ok", r, list(range(n1 + n2))) for r in (1, 2)]
        assert mq.security_stats()["auth_over_limit"] >= 1  # the third connection
    finally:
        mq.close()


@pytest.mark.timeout(120)
def test_a_key_holder_cannot_take_over_another_readers_control_connection(procs):
    """A holder of reader 2's key connects to the control port under routing id
    ``R1``, the id reader 1 used to have: with the writer's ROUTER_HANDOVER that
    closed reader 1's connection and every ack after it was lost (the writer
    timed out naming rank 1). Readers' ids now carry a random part."""
    n = 40  # several remote windows: the writer needs rank 1's acks throughout
    mq = MessageQueue(2, 0, connect_ip="127.0.0.1", name="sec-takeover")
    ctx = zmq.Context()
    try:
        for r in (1, 2):
            procs.start(legit_reader, mq.export_handle(r), r, n)
        mq.wait_until_ready(60)
        h2 = mq.export_handle(2)
        thief = _curve_client(ctx, zmq.DEALER, h2, h2.remote_ctl, routing_id=b"R1")
        thief.send(_hello(1))
        thief.send(CTL_ACK + struct.pack("<Q", 1))
        for i in range(n):
            mq.enqueue({"i": i, "secret": _SECRET}, timeout=30)
        reports = sorted(procs.get(60) for _ in range(2))
        assert reports == [("ok", r, list(range(n))) for r in (1, 2)]
        assert mq.security_stats()["bad_control"] >= 2
    finally:
        mq.close()
        ctx.destroy(linger=0)


# ------------------------------------- a key holder: idle connections, long messages, ids
def never_reading_sink(handle: Any, done: Any, out: Any) -> None:
    """With a reader's key: a second data connection that subscribes to the data
    topic and never reads (its receive buffers as small as it can make them)."""
    try:
        ctx = zmq.Context()
        s = ctx.socket(zmq.SUB)
        s.linger = 0
        s.rcvhwm = 1
        s.setsockopt(zmq.RCVBUF, 4096)
        s.curve_serverkey = handle.curve_server_key
        s.curve_publickey, s.curve_secretkey = (handle.curve_client_key,
                                                handle.curve_client_secret)
        s.connect(handle.remote_pub)
        s.subscribe(TOPIC_REMOTE)
        out.put(("sink", -1))
        done.wait(60)
        s.close()
        ctx.term()
    except BaseException:
        out.put(("error", -1, traceback.format_exc()))


@pytest.mark.timeout(120)
def test_a_connection_that_never_reads_holds_at_most_a_window_in_the_writer(procs):
    """A holder of reader 2's key opens a second data connection, subscribes to
    the data topic and never reads, while both readers read and ack, so flow
    control never holds the writer. The writer's queue for that connection is
    bounded (``outbound_queue_messages``): it holds a few windows of messages,
    not every message sent (before: +74 MiB for 300 x 256 KiB), and the real
    readers lose nothing."""
    import numpy as np

    n, warm = 160, 8
    payload = np.ones(256 << 10, dtype=np.uint8)
    mq = MessageQueue(2, 0, max_chunks=4, connect_ip="127.0.0.1", name="sec-outbound")
    done = procs.ctx.Event()
    try:
        for r in (1, 2):
            procs.start(legit_reader, mq.export_handle(r), r, n)
        mq.wait_until_ready(60)
        procs.start(never_reading_sink, mq.export_handle(2), done)
        assert procs.get(60)[0] == "sink"
        time.sleep(0.5)  # its subscription is in
        for i in range(warm):
            mq.enqueue({"i": i, "secret": _SECRET, "a": payload}, timeout=30)
        before = _rss()
        for i in range(warm, n):
            mq.enqueue({"i": i, "secret": _SECRET, "a": payload}, timeout=30)
        grown = _rss() - before
        reports = sorted(procs.get(60)[:3] for _ in range(2))
    finally:
        done.set()
        mq.close()
    assert reports == [("ok", r, list(range(n))) for r in (1, 2)]
    sent = (n - warm) * payload.nbytes
    assert grown < 20 << 20, (f"the writer grew by {grown >> 20} MiB for a connection that "
                              f"never reads ({sent >> 20} MiB sent)")


@pytest.mark.timeout(120)
def test_readers_that_ack_what_they_read_lose_nothing_to_the_outbound_bound(procs):
    """The data socket drops what a TCP connection's queue cannot take
    (``outbound_queue_messages``); flow control must keep every reader below it
    even when the writer runs at full speed on a small window (without the
    writer's taking in libzmq's reports of what left its queues after each ack,
    readers lost a message within the first few hundred)."""
    n = 1500
    mq = MessageQueue(2, 0, max_chunks=4, connect_ip="127.0.0.1", name="sec-nodrop")
    try:
        for r in (1, 2):
            procs.start(reader_until_the_end, mq.export_handle(r), r)
        mq.wait_until_ready(60)
        assert sorted(procs.get(60)[:2] for _ in range(2)) == [("ready", 1), ("ready", 2)]
        for i in range(n):
            mq.enqueue(i, timeout=30)
        mq.shutdown()
        ended = sorted(procs.get(60) for _ in range(2))
    finally:
        mq.close()
    assert ended == [("ended", r, n, "ClosedError") for r in (1, 2)], ended


def long_message_sender(handle: Any, parts: int, done: Any, out: Any) -> None:
    """With a reader's key, on the control port: one message of ``parts`` 1-byte parts."""
    try:
        ctx = zmq.Context()
        s = _curve_client(ctx, zmq.DEALER, handle, handle.remote_ctl)
        for _ in range(parts - 1):
            s.send(b"x", zmq.SNDMORE)
        s.send(b"x")
        out.put(("sent", -1))
        done.wait(60)
        s.close()
        ctx.term()
    except BaseException:
        out.put(("error", -1, traceback.format_exc()))


@pytest.mark.timeout(120)
def test_a_message_of_many_parts_cuts_the_key_off_without_stalling_an_enqueue(procs):
    """A holder of reader 2's key sends one control message of 100,000 one-byte
    parts (each part is within the frame size, and the per-connection queue
    counts whole messages). The writer reads it frame by frame: the key is cut
    off (PeerDiedError naming rank 2) and no enqueue builds the parts into a
    list (before: every part became a Python object in one drain, an enqueue
    stalled for seconds, and the queue went on)."""
    mq = MessageQueue(2, 0, connect_ip="127.0.0.1", name="sec-multipart")
    done = procs.ctx.Event()
    try:
        for r in (1, 2):
            procs.start(reader_until_the_end, mq.export_handle(r), r)
        mq.wait_until_ready(60)
        assert sorted(procs.get(60)[:2] for _ in range(2)) == [("ready", 1), ("ready", 2)]
        procs.start(long_message_sender, mq.export_handle(2), 100_000, done)
        assert procs.get(60)[0] == "sent"
        slowest, end, i = 0.0, time.monotonic() + 20, 0
        with pytest.raises(PeerDiedError, match="more parts") as info:
            while time.monotonic() < end:
                t0 = time.perf_counter()
                mq.enqueue({"i": i, "secret": _SECRET}, timeout=30)
                slowest = max(slowest, time.perf_counter() - t0)
                i += 1
                time.sleep(0.001)
        t0 = time.perf_counter()
        mq.security_stats()  # goes on dropping the parts, a bounded number per call
        stats_s = time.perf_counter() - t0
    finally:
        done.set()
        mq.close()
    assert info.value.peers == (2,)
    assert slowest < 1.0, f"an enqueue took {slowest * 1e3:.0f} ms"
    assert stats_s < 1.0, f"security_stats() took {stats_s * 1e3:.0f} ms"
    ended = sorted(procs.get(60) for _ in range(2))
    assert [e[1] for e in ended] == [1, 2], ended


def connect_and_close(endpoint: str, n: int, out: Any) -> None:
    """Without any key: ``n`` plain TCP connections to ``endpoint``, then close them."""
    try:
        conns = [socket.create_connection(("127.0.0.1", _port(endpoint)), timeout=10)
                 for _ in range(n)]
        time.sleep(0.2)
        for c in conns:
            c.close()
        out.put(("closed", -1))
    except BaseException:
        out.put(("error", -1, traceback.format_exc()))


def reader_reports_attached(handle: Any, rank: int, n: int, out: Any) -> None:
    """Attach (which sends the hello), report it, then read ``n`` messages."""
    try:
        with MessageQueue.create_from_handle(handle, rank) as mq:
            out.put(("attached", rank))
            mq.wait_until_ready(60)
            got = [mq.dequeue(timeout=60)["i"] for _ in range(n)]
        out.put(("ok", rank, got))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


@pytest.mark.timeout(120)
def test_a_closed_outsider_connection_does_not_make_a_live_reader_dead(procs):
    """An outsider without keys opens and closes plain connections to the control
    port just before the real reader connects. The writer's monitor reports each
    one's disconnect by file descriptor, and the reader's connection reuses one
    of those descriptors: the outsider's stale disconnect must not count as the
    reader's (before: read after the hello, it marked reader 1 dead and the
    writer raised PeerDiedError)."""
    n = 40
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1", name="sec-fdreuse")
    try:
        h = mq.export_handle()
        procs.start(connect_and_close, h.remote_ctl, 8)
        assert procs.get(60)[0] == "closed"
        time.sleep(0.5)  # the writer saw them close: their descriptors are free
        procs.start(reader_reports_attached, h, 1, n)
        assert procs.get(60)[0] == "attached"
        time.sleep(0.5)  # its hello is in the writer's socket
        mq.wait_until_ready(60)
        dead = dict(mq._writer._control.dead_remote)
        for i in range(n):
            mq.enqueue({"i": i, "secret": _SECRET}, timeout=30)
        assert procs.get(60) == ("ok", 1, list(range(n)))
    finally:
        mq.close()
    assert dead == {}


@pytest.mark.timeout(60)
def test_libzmqs_unsubscription_of_a_dropped_subscription_undoes_nothing():
    """A holder of reader 2's key subscribes to rank 1's joined topic on a second
    data connection (the writer drops it: not its key; libzmq still records it)
    and disconnects. libzmq's unsubscription then names rank 1's joined topic:
    it must not undo reader 1's real subscription (before: the writer never got
    ready)."""
    w = MessageQueue(2, 0, connect_ip="127.0.0.1", name="sec-unsub")
    h1, h2 = w.export_handle(1), w.export_handle(2)
    readers = [MessageQueue.create_from_handle(h1, 1)]
    ctx = zmq.Context()
    try:
        end = time.monotonic() + 10
        while w._writer._control.missing_readers() != ["1 remote reader(s)"]:
            assert time.monotonic() < end, w._writer._control.missing_readers()
            w.security_stats()
            time.sleep(0.02)
        s = _curve_client(ctx, zmq.XSUB, h2, h2.remote_pub)
        s.send(b"\x01j1")
        time.sleep(0.3)
        dropped = w.security_stats()["subscriptions_dropped"]
        s.close()
        time.sleep(0.3)  # libzmq's unsubscription is in
        w.security_stats()
        readers.append(MessageQueue.create_from_handle(h2, 2))
        w.wait_until_ready(10)
        w.enqueue({"secret": _SECRET}, timeout=10)
        for r in readers:
            assert r.dequeue(timeout=10) == {"secret": _SECRET}
    finally:
        for r in readers:
            r.close()
        w.close()
        ctx.term()
    assert dropped >= 1


def test_export_handle_refuses_a_rank_no_reader_can_have():
    """The writer's own rank and ranks beyond MAX_RANK are refused, and use up no
    key slot; create_from_handle refuses a remote rank beyond MAX_RANK."""
    from shm_broadcast.queue.transport import MAX_RANK

    with MessageQueue(2, 0, connect_ip="127.0.0.1", writer_rank=0, name="sec-rank") as w:
        with pytest.raises(ValueError, match=r"rank must be a reader's rank.*writer's own "
                                             r"rank 0, got 0"):
            w.export_handle(0)
        with pytest.raises(ValueError, match=f"got {MAX_RANK + 1}"):
            w.export_handle(MAX_RANK + 1)
        with pytest.raises(TypeError, match="rank must be an int"):
            w.export_handle("1")  # type: ignore[arg-type]  # the wrong type on purpose
        assert w.export_handle(1).curve_client_rank == 1  # both slots still free
        h = w.export_handle(2)
        assert h.curve_client_rank == 2
        with pytest.raises(ValueError, match=r"rank \(of a remote reader\) must be an int "
                                             f"<= {MAX_RANK}"):
            MessageQueue.create_from_handle(h, MAX_RANK + 1)
