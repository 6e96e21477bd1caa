"""Handle: everything a reader needs to connect to a MessageQueue's writer.

The handle every reader gets (:meth:`MessageQueue.export_handle()
<shm_broadcast.queue.message_queue.MessageQueue.export_handle>`) carries the
writer's CURVE *public* key, endpoints, sizes and the writer's identity. A
remote reader also needs a client keypair the writer admits, and has one of
its own by default:

* one it made itself, whose public half the writer was given
  (``create_from_process_group`` does this), passed to ``create_from_handle``
  as ``curve_keypair``;
* with a single remote reader, the one keypair the writer made, which the
  handle carries (``curve_client_key`` / ``curve_client_secret``,
  ``curve_client_rank`` None): every other holder of the handle is a local
  reader, which only the writer's own user can be;
* with several, one the writer made for that rank alone, in the handle
  ``export_handle(rank=r)`` returns (``curve_client_rank == r``); the handle
  without a rank then carries no secret. Rank ``r``'s handle is a credential
  of rank ``r`` only: send it to that reader only.

With ``shared_reader_key=True`` (an explicit opt-in) every handle carries one
client keypair that admits any of several remote readers
(``curve_client_rank`` None): every handle is then a credential of every
remote reader. Send a handle with
a secret only over the group's own channel, never through a shared store or a
log; its ``repr`` hides the secret. Local endpoints and doorbells are paths in
the writer's ``0700`` channel directory, which the handle names
(``bell_prefix``) but which only the writer's user can enter.
"""

from __future__ import annotations

import msgspec

__all__ = ["Handle"]


class Handle(msgspec.Struct, frozen=True, kw_only=True):
    """Small, msgspec- and pickle-serialisable description of a queue.

    Produced by :meth:`MessageQueue.export_handle` on the writer; pass it to
    every reader (``MessageQueue.create_from_handle(handle, rank)``).

    Attributes:
        name: Queue name used in every error message.
        n_reader: Total readers (local + remote).
        local_reader_ranks: Ranks served through shared memory, in reader-slot
            order; any other rank connecting is a remote (TCP) reader.
        max_chunk_bytes: Bytes per ring chunk.
        max_chunks: Chunks in the ring.
        segment: Shared-memory segment name (``None`` without local readers).
        bell_prefix: The queue's private channel directory followed by ``/``:
            the doorbells are files in it (:mod:`shm_broadcast.waiting.doorbell`).
        local_pub: Writer's same-node XPUB endpoint (overflow messages),
            ``ipc://`` in the channel directory.
        local_ctl: Writer's same-node ROUTER endpoint, likewise.
        remote_pub: Writer's TCP XPUB endpoint for remote readers, if any.
        remote_ctl: Writer's TCP ROUTER endpoint for remote readers, if any.
        writer_pid: Writer process id (liveness checks).
        writer_create_time: Writer process start time (pid reuse check).
        writer_host: Writer hostname.
        writer_rank: Writer's rank, for messages and for the ``peers`` of readers' errors.
        remote_window: Messages a remote reader may lag before the writer waits.
        curve_server_key: Z85 CURVE public key of the writer's TCP endpoints
            (``None`` without remote readers).
        curve_client_key: Z85 public key the writer's ZAP handler admits, when
            the handle carries a client keypair (module docstring).
        curve_client_secret: Z85 secret of that key (secret: see the module
            docstring).
        curve_client_rank: The one remote rank that keypair is for (None: a
            key every remote reader shares, or no keypair).
        writer_pid_space: The writer's
            :func:`~shm_broadcast.waiting.peer_watch.own_pid_space`: readers check its
            pid only from the same pid space.
    """

    name: str
    n_reader: int
    local_reader_ranks: tuple[int, ...]
    max_chunk_bytes: int
    max_chunks: int
    segment: str | None
    bell_prefix: str | None
    local_pub: str | None
    local_ctl: str | None
    remote_pub: str | None
    remote_ctl: str | None
    writer_pid: int
    writer_create_time: float
    writer_host: str
    writer_rank: int | None = None
    remote_window: int = 16
    curve_server_key: bytes | None = None
    curve_client_key: bytes | None = None
    curve_client_secret: bytes | None = None
    writer_pid_space: str = ""
    curve_client_rank: int | None = None

    def __repr__(self) -> str:
        fields = []
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if name == "curve_client_secret" and value is not None:
                value = "<secret>"
            fields.append(f"{name}={value!r}")
        return f"Handle({', '.join(fields)})"

    @property
    def remote_subscribe_addr(self) -> str | None:
        """vLLM's name of :attr:`remote_pub`."""
        return self.remote_pub

    def to_bytes(self) -> bytes:
        """Serialise with msgspec msgpack."""
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> Handle:
        """Inverse of :meth:`to_bytes`.

        Raises:
            ValueError: ``data`` is not a serialised handle.
        """
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except msgspec.DecodeError as e:
            raise ValueError(f"data is not a serialised MessageQueue Handle: {e}") from e
