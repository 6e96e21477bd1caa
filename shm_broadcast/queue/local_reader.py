"""LocalReader: a reader on the writer's node, served through the shared ring.

Per message: wait until chunk ``seq % max_chunks`` is readable for this
reader (``R_i == 0`` then ``W == 1``; see :mod:`shm_broadcast.queue.ring_buffer`),
decode straight from the shared memory (arrays are copied out), set ``R_i``,
and poke the writer if it declared itself parked on a full ring.

Waiting follows :class:`~shm_broadcast.waiting.policy.Backoff`; with a predictive
policy the wait for the next message is planned by an
:class:`~shm_broadcast.waiting.predictive.ArrivalPredictor` (sleep parked until just
before the expected publish, then poll; see :mod:`shm_broadcast.waiting.predictive`),
which learns from the publish time the writer stamps into every chunk.
A wait for a message that lasts is logged with the writer and how long ago
the last message arrived (:mod:`shm_broadcast.queue.laggards`; that age
comes from the writer's stamp in the released chunk of the last message,
read only when a warning is due, see "Diagnostics" in
:mod:`shm_broadcast.queue.ring_buffer`).
Parking (planned sleeps included) is the only delicate part -- the
lost-wakeup race::

    reader                                   writer
    ------                                   ------
    parked[i] := 1                           W := 1            (publish)
    full_fence()                             full_fence()
    if readable: unpark, go                  if any parked[j]: ring doorbell j
    poll(doorbell, <= park_poll_s)

Because each side stores, fences, then loads the other's flag, at least one
of them sees the other's store: either the reader finds the message before
sleeping, or the writer sees ``parked`` and rings. Either way no wakeup is
lost; and the bounded poll means even a bug here would cost latency, not a
hang.

Channels (see :mod:`shm_broadcast.queue.transport`): the reader binds its doorbell
``r<index>`` in the writer's ``0700`` channel directory *before* it sends its
hello, connects a line to the writer's doorbell and its zmq sockets to the
``ipc://`` paths there, none of which ever reconnect. The writer removes the
directory once every reader is attached, so closing must not need it; a
reader that finds the writer dead on close removes what is left of it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import psutil
import zmq

from shm_broadcast.codec.message_codec import Codec
from shm_broadcast.errors import (
    DecodeError,
    PeerDiedError,
    QueueClosedError,
    QueueTimeout,
    SegmentError,
    ShmBroadcastError,
)
from shm_broadcast.lifecycle.channel_dirs import check_private_dir, remove_dead_channel_dir
from shm_broadcast.queue.handle import Handle
from shm_broadcast.queue.laggards import (
    WRITER_STATE,
    LastMessage,
    WaitWarnings,
    logger,
    reader_warning,
)
from shm_broadcast.queue.options import DEFAULT_WARN_INTERVAL
from shm_broadcast.queue.ring_buffer import (
    CHUNK_HEADER,
    READER_CLOSED,
    REFUSED,
    TAKEN,
    ShmRingBuffer,
)
from shm_broadcast.queue.transport import (
    CTL_HELLO,
    KIND_DATA,
    KIND_OVERFLOW,
    TOPIC_OVERFLOW,
    WIRE,
    close_all,
    close_dealer,
    guard_zmq,
    new_socket,
    reader_routing_id,
    say_goodbye,
)
from shm_broadcast.waiting.doorbell import BellRinger, Doorbell, bell_address
from shm_broadcast.waiting.peer_watch import PeerWatch, own_pid_space
from shm_broadcast.waiting.policy import PARK, SLEEP, Backoff, WaitPolicy
from shm_broadcast.waiting.predictive import STAMP, STAMP_OFFSET, ArrivalPredictor
from shm_broadcast.waiting.thread_cpu import CpuHop

__all__ = ["LocalReader"]

#: An overflow message's payload is already in flight when its chunk is
#: published; give it at least this long even under ``timeout=0``.
_OVERFLOW_MIN_WAIT = 2.0

#: Largest message kept for warming the decoder up (:meth:`LocalReader._warm_up`).
_WARM_MAX = 64 << 10

#: Where the msgpack bytes start in an overflow frame: topic byte + header.
_HEAD = 1 + WIRE.size


_unpack_stamp = STAMP.unpack_from

#: When a wait for a message began and when it saw the message (monotonic);
#: both None when the message was there (or no predictor asked).
_Waited = tuple[float | None, float | None]
_NOT_WAITED: _Waited = (None, None)


def _never() -> bool:
    return False


class LocalReader:
    """Reader side through shared memory; used through :class:`MessageQueue`.

    Args:
        handle: The writer's handle.
        index: This reader's slot (position of its rank in
            ``handle.local_reader_ranks``).
        rank: This reader's rank (messages only).
        policy: Waiting policy.
        codec: Decoder.
        warn_interval: Seconds a wait for a message lasts before it is logged
            (with the writer and the last message's age), and between such
            warnings (> 0).
    """

    def __init__(self, handle: Handle, index: int, rank: int, policy: WaitPolicy,
                 codec: Codec, warn_interval: float = DEFAULT_WARN_INTERVAL) -> None:
        self.name = handle.name
        self.index = index
        self.rank = rank
        self.side = f"reader rank {rank}"
        self.max_chunks = handle.max_chunks
        self.codec = codec
        self._pid = os.getpid()
        self._owner_thread = threading.get_ident()
        self._writer = PeerWatch(handle.writer_pid, handle.writer_create_time,
                                 handle.writer_host, pid_space=handle.writer_pid_space)
        wr = "" if handle.writer_rank is None else f" rank {handle.writer_rank}"
        self._writer_desc = f"writer{wr} ({self._writer.describe()})"
        #: What errors put in ``peers`` for the writer: its rank where the handle
        #: has one (a group's queue), else the role.
        self._writer_peer: int | str = ("writer" if handle.writer_rank is None
                                        else handle.writer_rank)
        self._seq = 0
        #: Parks on the doorbell, those that ended by timeout rather than a ring,
        #: planned sleeps (predictive policy) and those a ring cut short.
        self.park_stats = {"parks": 0, "timeouts": 0, "sleeps": 0, "sleeps_rung": 0}
        self._predictor = ArrivalPredictor(policy.predict) if policy.predict else None
        #: Moves off a CPU a planned poll found shared (predictive policy only),
        #: and the polls found shared so far, as last handed to it.
        self._hop = (CpuHop() if policy.predict is not None and policy.predict.leave_shared_cpu
                     else None)
        self._contended_seen = 0
        #: What the predictor learns from the last message, handed over at the
        #: next dequeue (off the message's path): its stamp, and when the wait
        #: for it began and saw it (both None: it was there).
        self._learning: tuple[float, _Waited] | None = None
        #: A copy of the last plain message, decoded again when a planned
        #: sleep ends (see :meth:`_warm_up`); never kept when pickle is allowed.
        self._warm_msg: bytes | None = None
        self._keep_warm = self._predictor is not None and not codec.allow_pickle
        self._ready = False
        self._closing = False
        self._closed = False
        self._stash: collections.deque[list[zmq.Frame]] = collections.deque()
        #: While waiting for an overflow payload: until when it may still arrive.
        self._in_flight_until: float | None = None
        self._cond: Callable[[], bool] = _never
        self._wait_what: str | None = ""
        self._wait_timeout: float | None = None
        self._backoff = Backoff(policy, self._check_wait)
        self._warnings = WaitWarnings(warn_interval)
        #: Everything this reader holds (ring, doorbell, lines, sockets), released
        #: in reverse order of creation by :meth:`close` or by a failed construction.
        self._resources = contextlib.ExitStack()
        #: When this reader connected (its warnings count from it before any message).
        self._connected_at = time.monotonic()
        try:
            self._attach(handle, index)
        except BaseException:
            self._closed = True
            self._resources.close()
            raise

    def _attach(self, handle: Handle, index: int) -> None:
        """Map the ring, take slot ``index``, bind the doorbell, connect, say hello.

        Each resource's release is registered as soon as it exists.
        """
        res = self._resources
        prefix = handle.bell_prefix
        if prefix is not None:  # released last: what a writer killed early left behind
            res.callback(_remove_if_writer_dead, prefix.rstrip(os.sep), self._writer)
        if (handle.segment is None or handle.local_pub is None or handle.local_ctl is None
                or prefix is None):
            raise ValueError(f"handle of queue {handle.name!r} has no local readers")
        ringer = BellRinger()
        res.callback(ringer.close)
        self._ring_writer = ringer.line(bell_address(prefix, "w"))
        self.ring = ring = ShmRingBuffer.attach(handle.segment)
        res.callback(ring.close)
        _check_geometry(ring, handle, len(handle.local_reader_ranks))
        self._strong = ring.strongly_ordered
        self._parked_at = ring.reader_parked_offset(index)
        self._flag_at = [ring.flag_offsets(c, index) for c in range(ring.max_chunks)]
        self._data_at = [ring.data_offset(c) for c in range(ring.max_chunks)]
        self._chunk_bytes = ring.max_chunk_bytes
        ctime = psutil.Process(self._pid).create_time()
        ring.register_reader(index, self._pid, ctime)
        check_private_dir(prefix.rstrip(os.sep))  # before any bind or connect
        self._doorbell = Doorbell(bell_address(prefix, f"r{index}"))
        res.callback(self._doorbell.close)
        self._ring_writer.connect()  # the writer's bell exists as long as its handle
        self._connect(handle.local_pub, handle.local_ctl, ctime)

    def _connect(self, local_pub: str, local_ctl: str, ctime: float) -> None:
        """Connect the overflow SUB and the control DEALER (ipc), then say hello.

        The hello goes last: the writer accepts it only from the process
        registered in this reader's ring slot, with this doorbell bound.
        """
        res = self._resources
        ctx = zmq.Context(io_threads=1)
        res.callback(ctx.term)
        self.sub = sub = new_socket(ctx, zmq.SUB)
        res.callback(close_all, sub)
        self.dealer = dealer = new_socket(ctx, zmq.DEALER)
        res.callback(close_dealer, dealer)
        res.callback(guard_zmq(self, ctx, [sub, dealer]).detach)
        try:
            sub.connect(local_pub)
            sub.subscribe(TOPIC_OVERFLOW)
            dealer.setsockopt(zmq.ROUTING_ID, reader_routing_id(b"L", self.index))
            dealer.connect(local_ctl)
            dealer.send(CTL_HELLO + msgspec.msgpack.encode(
                [self.rank, self._pid, ctime, socket.gethostname(), own_pid_space()]))
        except BaseException:
            _leave(self.ring, self.index, self._ring_writer, dealer, self._owner_thread)
            raise

    # ------------------------------------------------------------- waiting
    def wait_until_ready(self, timeout: float | None) -> None:
        """Block until the writer saw every reader connect."""
        self._check_open("wait_until_ready")  # also once ready: a closed queue is unusable
        if self._ready:
            return
        ring = self.ring
        self._wait("the writer to see all readers connected", ring.is_ready, timeout)
        self._ready = True

    def _wait(self, what: str | None, cond: Callable[[], bool], timeout: float | None,
              predictor: ArrivalPredictor | None = None) -> _Waited:
        """Wait until ``cond()``; ``what`` names it in errors (``None``: the next message).

        With a ``predictor`` (the next message, predictive policy) the wait is
        planned by it, and the wait's start and the moment it saw the message
        are returned for it to learn from later (:meth:`_learn`).
        """
        self._cond, self._wait_what, self._wait_timeout = cond, what, timeout
        b = self._backoff
        now = time.monotonic()
        if what is None:
            self._warnings.start(now)
        else:
            self._warnings.stop()
        plan = predictor.plan(now) if predictor is not None else None
        if plan is not None and plan.sleep_until > now and self._hop is not None:
            self._leave_shared_cpu(self._hop)  # a sleep follows: the move is off the path
        b.start(None if timeout is None else now + timeout, plan, now)
        while not cond():
            phase = b.step()
            if phase >= PARK and self._park(cond, b.park_timeout(), phase == SLEEP):
                break
        return _NOT_WAITED if predictor is None else (now, time.monotonic())

    def _park(self, cond: Callable[[], bool], seconds: float, planned: bool = False) -> bool:
        """Sleep on the doorbell; returns True when ``cond()`` held on waking.

        ``planned``: a predictive sleep (to the microsecond; its oversleep is
        learned) instead of a park. Both are the same handshake.

        The path after a ring is deliberately short (raw flag bytes, no method
        calls): a reader idle for a while wakes with cold caches, where each
        Python call costs microseconds of the wake-up latency.
        """
        ring = self.ring
        buf = ring.buf
        flag = self._parked_at
        self._doorbell.drain()  # rings from before this park are stale
        ring.set_reader_parked(self.index, True)
        ring.full_fence()
        try:
            if cond():
                return True
            if not (ring.is_shutdown() or self._closing):
                stats = self.park_stats
                stats["sleeps" if planned else "parks"] += 1
                if (self._doorbell.sleep(seconds) if planned else self._doorbell.wait(seconds)):
                    buf[flag] = 0
                    if planned:
                        stats["sleeps_rung"] += 1
                    if cond():
                        return True
                    self._backoff.rearm()  # a message is on its way: poll, don't re-park
                elif planned:
                    self._learn_oversleep()
                    self._warm_up()
                else:
                    stats["timeouts"] += 1
        finally:
            buf[flag] = 0
        if (self._closing or ring.is_shutdown()) and not cond():
            self._check_wait(False)
        return False

    def _learn(self, predictor: ArrivalPredictor, learning: tuple[float, _Waited]) -> None:
        """Hand the last message's timing to the predictor."""
        stamp, (began, seen) = learning
        self._learning = None
        predictor.observe(stamp, began, seen)

    def _leave_shared_cpu(self, hop: CpuHop) -> None:
        """Before a planned sleep: move to another CPU if the polls since the last
        such sleep found this one shared. The move (~40 us) is off the message's
        path: it runs only where a sleep of at least ``min_sleep_s`` follows,
        never before a message already there or a wait that polls at once."""
        contended = self._backoff.contended
        hop.before_sleep(contended != self._contended_seen)
        self._contended_seen = contended

    def _warm_up(self) -> None:
        """Decode the last message again, result discarded, as the window opens.

        After a sleep of a whole step, other processes have evicted the
        decoder's code and data from the caches, so the first decode after it
        is slower than a warm one. Doing one decode now, before the message is
        due, moves that cost off the message's path. Only plain messages (no
        arrays, no pickle: decoding has no side effects) are kept for this.
        """
        msg = self._warm_msg
        if msg is not None:
            try:
                self.codec.decode(msg, b"", 0, 0)
            except DecodeError:  # cannot happen (it decoded before); never keep trying
                self._warm_msg = None

    def _learn_oversleep(self) -> None:
        """After a planned sleep's timer: how late did we get the CPU back?"""
        late = time.monotonic() - self._backoff.sleep_until
        predictor = self._predictor
        if late >= 0.0 and predictor is not None:  # else cut short by a liveness check
            predictor.overslept(late)

    def _drain_sub(self) -> None:
        sub = self.sub
        try:
            while True:
                frames = sub.recv_multipart(zmq.NOBLOCK, copy=False)
                self._stash.append(frames)  # overflow payload: keep it for its chunk
        except zmq.Again:
            pass

    def _check_wait(self, expired: bool) -> None:
        if self._wait_what is None:
            self._wait_what = f"message #{self._seq}"
        if self._closing:
            raise QueueClosedError(
                f"queue {self.name!r}: {self.side} was shut down while waiting for "
                f"{self._wait_what}", queue=self.name, side=self.side)
        if self._cond():
            return
        if self._in_flight_until is not None and (self.ring.is_shutdown()
                                                  or not self._writer.alive()):
            # A published overflow chunk's payload was sent before the chunk:
            # it is in flight (zmq keeps what arrived before the connection
            # dropped), so the writer's shutdown or exit is no reason to stop
            # waiting for it -- for _OVERFLOW_MIN_WAIT at most.
            self._drain_sub()
            if self._cond() or time.monotonic() < self._in_flight_until:
                return
        if self.ring.is_shutdown():
            raise QueueClosedError(
                f"queue {self.name!r}: the {self._writer_desc} shut the queue down; "
                f"{self.side} waited for {self._wait_what}", queue=self.name, side=self.side,
                peers=[self._writer_peer])
        if not self._writer.alive():
            if self._cond():
                return
            raise PeerDiedError(
                f"queue {self.name!r}: the {self._writer_desc} died while {self.side} "
                f"waited for {self._wait_what}", queue=self.name, side=self.side,
                peers=[self._writer_peer])
        if expired:
            raise QueueTimeout(
                f"queue {self.name!r}: {self.side} timed out after {self._wait_timeout:g} s "
                f"waiting for {self._wait_what} (the {self._writer_desc} is "
                f"{WRITER_STATE[self._writer.state()]} but sent nothing)", queue=self.name,
                side=self.side, peers=[self._writer_peer])
        now = time.monotonic()
        if self._warnings.due(now):
            logger.warning(reader_warning(
                self.name, self.side, now - self._warnings.began, self._seq, self._writer_desc,
                self._writer.state(), self._last_message(now)))

    def _last_message(self, now: float) -> LastMessage:
        """How long ago message ``seq - 1`` arrived (for a warning of the wait for ``seq``).

        Its publish stamp is read from its chunk, which this reader released:
        the stamp first, then the chunk's message number, and the stamp is
        trusted only if that number is still ``seq - 1`` (the writer stores
        the number first; see "Diagnostics" in
        :mod:`shm_broadcast.queue.ring_buffer`). A chunk already reused, or a
        stamp from a clock this process does not share, gives the wait's
        length as a lower bound instead.
        """
        seq = self._seq
        if seq == 0:
            return LastMessage("none", now - self._connected_at)
        buf = self.ring.buf
        d = self._data_at[(seq - 1) % self.max_chunks]
        (stamp,) = _unpack_stamp(buf, d + STAMP_OFFSET)
        self.ring.acquire_fence()  # the stamp's load before the number's (no-op on x86)
        if WIRE.unpack_from(buf, d)[0] == seq - 1 and self._connected_at <= stamp <= now:
            return LastMessage("arrived", now - stamp)
        return LastMessage("before", now - self._warnings.began)

    @property
    def predictor_stats(self) -> dict[str, int]:
        """The predictor's counters (see :class:`ArrivalPredictor`) and
        ``contended`` (planned polls that parked because the CPU was shared)
        ``cpu_moves`` (moves to another CPU after such a poll: see
        ``PredictivePolicy.leave_shared_cpu``) and ``cpu_moves_no_free_cpu``
        (moves not made: no CPU was likely free); empty without a predictor."""
        if self._predictor is None:
            return {}
        hop = self._hop
        return {**self._predictor.stats, "contended": self._backoff.contended,
                "cpu_moves": 0 if hop is None else hop.moves,
                "cpu_moves_no_free_cpu": 0 if hop is None else hop.no_free_cpu}

    # ------------------------------------------------------------- dequeue
    def poll(self) -> bool:
        """Whether :meth:`dequeue` would return without waiting for the writer."""
        if self._closed:
            return False
        return self.ring.is_readable(self._seq % self.max_chunks, self.index)

    def dequeue(self, timeout: float | None,
                verdict: Callable[[Any], str | None] | None = None) -> Any:
        """Receive the next message; ``verdict`` (see :meth:`MessageQueue.dequeue`)
        judges it before its chunk is released."""
        if self._closing or not self._ready:
            self._check_open("dequeue")
            if self._closing:
                raise QueueClosedError(f"queue {self.name!r}: {self.side} was shut down",
                                       queue=self.name, side=self.side)
            self.wait_until_ready(timeout if timeout is not None else 120.0)
        ring = self.ring
        seq = self._seq
        chunk = seq % self.max_chunks
        buf = ring.buf
        w_at, r_at = self._flag_at[chunk]
        # Inlined ShmRingBuffer.is_readable: R_i first, then W.
        pred = self._predictor
        if pred is not None and self._learning is not None:
            self._learn(pred, self._learning)  # the previous message, now that we are idle
        waited = _NOT_WAITED
        if not (buf[r_at] == 0 and buf[w_at] == 1):
            waited = self._wait(None, lambda: buf[r_at] == 0 and buf[w_at] == 1, timeout, pred)
        if not self._strong:
            ring.acquire_fence()
        d = self._data_at[chunk]
        if pred is not None:  # the stamp, like the payload, is ours until R_i := 1
            self._learning = (_unpack_stamp(buf, d + STAMP_OFFSET)[0], waited)
        wseq, kind, mlen, blen = WIRE.unpack_from(buf, d)
        if wseq != seq:
            raise DecodeError(
                f"queue {self.name!r}: {self.side} expected message #{seq} but chunk "
                f"{chunk} holds #{wseq}; the ring is corrupt")
        if kind == KIND_OVERFLOW:
            frames = self._recv_overflow(seq, timeout)
            return self._judged(chunk, seq, verdict, self._decode_overflow, frames, seq,
                                mlen, blen)
        boff = CHUNK_HEADER + (mlen + 63) // 64 * 64
        if kind != KIND_DATA or (boff + blen if blen else CHUNK_HEADER + mlen) > self._chunk_bytes:
            raise DecodeError(
                f"queue {self.name!r}: {self.side} found message #{seq} in chunk {chunk} with "
                f"kind {kind}, {mlen} + {blen} bytes, which a {self._chunk_bytes}-byte chunk "
                f"cannot hold; the ring is corrupt")
        m = d + CHUNK_HEADER
        if verdict is not None:
            return self._judged(chunk, seq, verdict, self.codec.decode, buf[m : m + mlen], buf,
                                d + boff, blen)
        try:
            obj = self.codec.decode(buf[m : m + mlen], buf, d + boff, blen)
            if self._keep_warm and blen == 0 and mlen <= _WARM_MAX:
                self._warm_msg = bytes(buf[m : m + mlen])
            return obj
        except DecodeError as e:
            raise self._refused(seq, e) from None
        finally:
            self._consume(chunk)

    def _refused(self, seq: int, e: DecodeError) -> DecodeError:
        """The codec's refusal of message ``seq``, naming the queue and its writer."""
        return DecodeError(
            f"queue {self.name!r}: {self.side} refused message #{seq} from the "
            f"{self._writer_desc}: {e}", queue=self.name, side=self.side,
            peers=[self._writer_peer])

    def _judged(self, chunk: int, seq: int, verdict: Callable[[Any], str | None] | None,
                decode: Callable[..., Any], *args: Any) -> Any:
        """Decode message ``seq``, let ``verdict`` judge (a decode error or a raising
        verdict refuses the message with its text, then propagates), then release
        the chunk."""
        refusal: str | None = None
        try:
            try:
                obj = decode(*args)
            except DecodeError as e:
                raise self._refused(seq, e) from None
            if verdict is not None:
                said = verdict(obj)
                refusal = None if said is None else str(said)
            return obj
        except BaseException as e:
            if verdict is not None:
                refusal = f"{type(e).__name__}: {e}"
            raise
        finally:
            self._consume(chunk, refusal)

    def _consume(self, chunk: int, refusal: str | None = None) -> None:
        """ShmRingBuffer.mark_read (or a refusal's verdict), then poke a parked
        writer; the flag stores are inlined at the ring's own offsets (this runs
        once per message)."""
        ring = self.ring
        if refusal is not None:
            ring.write_refusal(self.index, refusal)
        if not self._strong:
            ring.release_fence()
        ring.buf[self._flag_at[chunk][1]] = TAKEN if refusal is None else REFUSED
        self._seq += 1
        ring.full_fence()
        if ring.buf[ring.writer_parked_offset] and ring.take_writer_parked():
            self._ring_writer()

    def _decode_overflow(self, frames: list[zmq.Frame], seq: int, mlen: int, blen: int) -> Any:
        """Decode overflow message ``seq`` from its frames (this process's own), once
        they are known to hold exactly the ``mlen`` + ``blen`` bytes its chunk says.

        Raises:
            DecodeError: They do not (the message is refused).
        """
        if (len(frames) != 2 or len(frames[0].buffer) != _HEAD + mlen
                or len(frames[1].buffer) != blen):
            raise DecodeError(
                f"queue {self.name!r}: {self.side} got a malformed payload for overflow "
                f"message #{seq}: {len(frames)} frame(s) of "
                f"{[len(f.buffer) for f in frames[:3]]} bytes where its chunk says "
                f"{_HEAD + mlen} and {blen}")
        head = frames[0].buffer  # topic byte, header, msgpack
        return self.codec.decode(head[_HEAD : _HEAD + mlen], frames[1].buffer, 0, blen, True)

    def _recv_overflow(self, seq: int, timeout: float | None) -> list[zmq.Frame]:
        def have() -> bool:
            while self._stash:
                s = _overflow_seq(self._stash[0])
                if s is None or s >= seq:  # a malformed payload is refused by its chunk
                    return True
                self._stash.popleft()  # stale: cannot happen, but never block on it
            return False

        wait = None if timeout is None else max(timeout, _OVERFLOW_MIN_WAIT)
        self._cond, self._wait_what, self._wait_timeout = (
            have, f"the payload of overflow message #{seq}", wait)
        self._warnings.stop()
        b = self._backoff
        now = time.monotonic()
        b.start(None if wait is None else now + wait)
        self._in_flight_until = now + _OVERFLOW_MIN_WAIT
        try:
            while not have():
                b.step()
                if self.sub.poll(max(1, int(b.park_timeout() * 1000))):
                    self._drain_sub()
        finally:
            self._in_flight_until = None
        frames = self._stash.popleft()
        s = _overflow_seq(frames)
        if s is not None and s != seq:
            raise ShmBroadcastError(
                f"queue {self.name!r}: {self.side} expected overflow payload #{seq}, got #{s}")
        return frames

    # ----------------------------------------------------------- lifecycle
    def _check_open(self, op: str) -> None:
        if self._closed:
            raise QueueClosedError(f"queue {self.name!r}: {op}() on a closed queue",
                                   queue=self.name, side=self.side)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def shutdown(self) -> None:
        """Stop reading: blocked calls raise QueueClosedError; the writer is told."""
        if self._closing:
            return
        self._closing = True
        self._doorbell.ring_self()  # wake our own blocked call
        _leave(self.ring, self.index, self._ring_writer, self.dealer, self._owner_thread)

    def close(self) -> None:
        """Leave the queue (the segment stays, the writer owns it). Idempotent."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True
            return
        self.shutdown()
        self._closed = True
        self._stash.clear()
        self._resources.close()


def _leave(ring: ShmRingBuffer, index: int, ring_writer: Callable[[], None],
           dealer: zmq.SyncSocket, owner_thread: int) -> None:
    """Tell the writer reader ``index`` leaves: its slot says closed (a writer waiting
    for it re-checks at once) and, from the owning thread, a goodbye on ``dealer``."""
    if not ring.closed:
        ring.set_reader_state(index, READER_CLOSED)
        ring_writer()
    say_goodbye(dealer, owner_thread)


def _remove_if_writer_dead(channel_dir: str, writer: PeerWatch) -> None:
    """A writer killed before every reader attached left its channel directory:
    the reader removes it on leaving (only if its owner record says so too)."""
    if not writer.alive():
        remove_dead_channel_dir(channel_dir)


def _check_geometry(ring: ShmRingBuffer, handle: Handle, n_local: int) -> None:
    """Refuse a ring whose own header disagrees with the handle that named it.

    A reader maps the ring as its header describes it, and the handle came
    from elsewhere (a peer, a file): a mismatch means one of them is not what
    the writer made, and reading by either would misplace chunks.

    Raises:
        SegmentError: The header's readers, chunks or chunk size differ from
            the handle's.
    """
    have = (ring.n_reader, ring.max_chunks, ring.max_chunk_bytes)
    want = (n_local, handle.max_chunks, handle.max_chunk_bytes)
    if have != want:
        raise SegmentError(
            f"ring {ring.name!r} of queue {handle.name!r} holds {have[0]} readers x "
            f"{have[1]} chunks of {have[2]} bytes, but its handle says {want[0]} x "
            f"{want[1]} of {want[2]}: refusing to read it")


def _overflow_seq(frames: list[zmq.Frame]) -> int | None:
    """The message number of an overflow payload, None when its frames are not the
    writer's layout (two frames, the first holding at least the header)."""
    if len(frames) != 2 or len(frames[0].buffer) < _HEAD:
        return None
    seq: int = WIRE.unpack_from(frames[0].buffer, 1)[0]
    return seq
