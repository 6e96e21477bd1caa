"""Starting torch.distributed for the world group: the checks, and the call.

Everything :func:`coordinator.parallel_state.init_distributed_environment` can
refuse is refused here before ``dist.init_process_group`` runs (a refused call
leaves no half-initialised process group behind), or, when the world group
already exists, before it is handed back for a request it does not match.
"""

from __future__ import annotations

import datetime
import os
import re
import urllib.parse
from typing import Any

import torch.distributed as dist

from coordinator.group.gloo_interface import gloo_interface_for, pinned_gloo
from shm_broadcast.ranks.group_adapter import CLOSED_WORDS, TIMEOUT_WORDS
from shm_broadcast.ranks.tcp_store import master_store, rank0_store_client

__all__ = ["check_init_method", "check_local_rank", "check_same_world", "env_local_rank_of",
           "init_torch_distributed"]

_SCHEMES = ("env", "tcp", "file")


def check_init_method(method: Any) -> None:
    """``env://``, ``tcp://host:port`` or ``file://<path in an existing directory>``."""
    if not isinstance(method, str):
        raise TypeError(f"distributed_init_method must be a str, got {type(method).__name__}")
    scheme, sep, rest = method.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise ValueError(f"distributed_init_method must be 'env://', 'tcp://host:port' or "
                         f"'file:///path', got {method!r}")
    if scheme == "file":
        folder = os.path.dirname(rest) or "."
        if not os.path.isdir(folder):
            raise ValueError(f"distributed_init_method {method!r} names a file in {folder!r}, "
                             f"which is not an existing directory")


def check_local_rank(local_rank: int) -> None:
    """``local_rank`` is -1 (find it) or a rank ``>= 0``."""
    if local_rank < -1:
        raise ValueError(f"local_rank must be >= 0, or -1 to take it from the launcher, got "
                         f"{local_rank}")


def _env_int(name: str) -> int | None:
    """An int environment variable (None when unset)."""
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"the {name} environment variable must be an int >= 0, got {text!r}")
    return value


def _or_unset(value: int | None) -> int:
    """-1 (left to torch) for an unset variable."""
    return -1 if value is None else value


def env_local_rank_of(method: str) -> int | None:
    """``LOCAL_RANK`` under env:// (a launcher set it); None elsewhere, where the
    global rank stands in (one node), as in vLLM."""
    return _env_int("LOCAL_RANK") if method.startswith("env://") else None


def _rank_and_size(world_size: int, rank: int, method: str) -> tuple[int, int]:
    """The rank and world size the call will use (-1: left to torch)."""
    if method.startswith("env://"):
        world_size = world_size if world_size >= 1 else _or_unset(_env_int("WORLD_SIZE"))
        rank = rank if rank >= 0 else _or_unset(_env_int("RANK"))
    elif world_size < 1 or rank < 0:
        raise ValueError(
            f"{method.split('://')[0]}:// needs world_size >= 1 and "
            f"rank >= 0, got world_size={world_size}, rank={rank}")
    return world_size, rank


def init_torch_distributed(world_size: int, rank: int, method: str, backend: str,
                           timeout: datetime.timedelta) -> str | None:
    """``dist.init_process_group`` with the caller's arguments and the timeout,
    after checking the rank against the world size (env:// included: a launcher
    variable out of range would otherwise wait for peers until the timeout).

    Returns:
        The interface gloo listens on for a loopback rendezvous
        (:func:`coordinator.group.gloo_interface.gloo_interface_for`; the groups built
        later for this world use it too), or None.
    """
    size, me = _rank_and_size(world_size, rank, method)
    if size >= 1 and me != -1 and not 0 <= me < size:
        where = "" if rank >= 0 and world_size >= 1 else " (from RANK / WORLD_SIZE)"
        raise ValueError(f"rank must be in [0, {size}), got {me}{where}")
    pinned = gloo_interface_for(_rendezvous_host(method))
    with pinned_gloo(pinned):
        _init_process_group(size, me, method, backend, timeout)
    return pinned


def _init_process_group(size: int, me: int, method: str, backend: str,
                        timeout: datetime.timedelta) -> None:
    """``dist.init_process_group`` over our rendezvous store where there is one
    (its failures become our errors), else with torch's own ``init_method``."""
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    store = _rendezvous_store(method, size, me, timeout)
    if store is not None:  # rank and size are known: tcp:// requires them, env:// set them
        try:
            dist.init_process_group(**kwargs, store=store, world_size=size, rank=me)
        except RuntimeError as e:  # DistStoreError and gloo's errors are RuntimeErrors
            ours = _init_error(e, size, me, timeout, store)
            if ours is e:
                raise
            raise ours from e
        return
    kwargs["init_method"] = method
    if size >= 1:
        kwargs["world_size"] = size
    if me >= 0:
        kwargs["rank"] = me
    dist.init_process_group(**kwargs)


def _rendezvous_host(method: str) -> str | None:
    """The rendezvous host of ``tcp://host:port`` or env:// (``MASTER_ADDR``); None
    for ``file://``."""
    if method.startswith("tcp://"):
        return urllib.parse.urlparse(method).hostname
    if method.startswith("env://"):
        return os.environ.get("MASTER_ADDR")
    return None


def _rendezvous_store(method: str, size: int, me: int,
                      timeout: datetime.timedelta) -> dist.Store | None:
    """The rendezvous store of ``tcp://host:port`` or ``env://`` (``MASTER_ADDR``,
    ``MASTER_PORT``), with rank 0's server listening on that address only (torch's
    own would listen on every interface); None where torch should decide:
    ``file://``, a launcher's agent store (torchrun), or settings torch
    reports better itself (a missing variable).

    Raises:
        StoreConnectionError: Rank 0 cannot listen on the address.
    """
    from coordinator.errors import StoreConnectionError

    if size < 1 or me < 0:
        return None
    if method.startswith("tcp://"):
        parsed = urllib.parse.urlparse(method)
        host, port = parsed.hostname, parsed.port
    elif method.startswith("env://") and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        host, port = os.environ.get("MASTER_ADDR"), _env_int("MASTER_PORT")
    else:
        return None
    if not host or port is None:
        return None
    if me != 0:
        return dist.PrefixStore("default_pg", rank0_store_client(
            host, port, size, timeout, who=f"world group (rank {me}/{size})",
            op="init_distributed_environment", queue="world"))
    try:
        server = master_store(host, port, size, timeout)
    except OSError as e:
        raise StoreConnectionError(
            f"rank 0 cannot listen on {host}:{port} (distributed_init_method {method!r}): "
            f"{e.strerror or e} (errno {e.errno}); pick a free port or an address of this host"
        ) from e
    return dist.PrefixStore("default_pg", server)


def check_same_world(world: Any, rank: int, local_rank: int, seconds: float | None,
                     allow_pickle: bool) -> None:
    """The existing world group is what this call asks for (else ValueError:
    it is handed back only unchanged)."""
    asked = [("rank", rank, world.rank, rank >= 0),
             ("local_rank", local_rank, world.local_rank, local_rank >= 0),
             ("timeout", seconds, world.timeout, seconds is not None),
             ("allow_pickle", allow_pickle, world.allow_pickle, allow_pickle)]
    for name, want, have, given in asked:
        if given and want != have:
            raise ValueError(
                f"the world group already exists with {name}={have!r}, but {name}={want!r} "
                f"was requested; call destroy_distributed_environment() first to change it")


def _init_error(e: RuntimeError, size: int, me: int, timeout: datetime.timedelta,
                store: dist.Store | None = None) -> Exception:
    """Our error for ``init_process_group`` over our store that failed waiting for peers
    (torch's store names only the first key that never came; rank 0, which serves the
    store, looks up every rank's key)."""
    from coordinator.errors import CommTimeout, PeerDiedError

    first = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    others = [r for r in range(size) if r != me]
    where = f"world group (rank {me}/{size}), op init_distributed_environment"
    low = first.lower()
    if isinstance(e, dist.DistNetworkError) and me != 0:
        return PeerDiedError(f"{where}: rank 0's store closed the connection during the "
                             f"rendezvous (rank 0 exited, or gave up waiting for another rank). "
                             f"Detail: {first}", queue="world", peers=[0])
    if any(w in low for w in CLOSED_WORDS):
        return PeerDiedError(f"{where}: a rank's connection closed during the rendezvous, so one "
                             f"of ranks {others} exited. Detail: {first}",
                             queue="world", peers=others)
    if any(w in low for w in TIMEOUT_WORDS):
        missing = _ranks_in_keys(first, size, me)
        absent = _absent_in_store(store, first, size, me) if me == 0 and missing else None
        if absent:
            missing, who = absent, f"rank(s) {absent} did not arrive"
        else:
            who = (f"rank(s) {missing} did not arrive (the rendezvous waits for the ranks in "
                   f"order: later ones may be missing too)" if missing else
                   f"not every rank arrived; any of ranks {others} may be missing")
        return CommTimeout(f"{where}: {who} within {timeout.total_seconds():g}s (each must call "
                           f"it with the same world size and address). Detail: {first}",
                           queue="world", peers=missing or others)
    return e


def _absent_in_store(store: dist.Store | None, text: str, size: int, me: int) -> list[int] | None:
    """Every rank that wrote no rendezvous key to ``store``: the keys listed there whose
    stem (the key less its trailing rank) ends the stem of the key the timeout ``text``
    names (``keys: /<prefix>/<stem>/<rank>``); None when the store cannot list its keys
    or this rank's own key is not among them (the form is then not the one assumed)."""
    named = re.findall(r"keys:\s*(\S+?)/\d+(?=[\s,\]]|$)", text)
    if store is None or not named:
        return None
    try:
        listed = store.list_keys()
    except (AttributeError, RuntimeError):  # torch without list_keys, or a store without it
        return None
    arrived = set()
    for key in listed:
        stem, _, tail = str(key).rpartition("/")
        if stem and tail.isdigit() and named[0].endswith(stem):
            arrived.add(int(tail))
    if me not in arrived:
        return None
    return [r for r in range(size) if r not in arrived]


def _ranks_in_keys(text: str, size: int, me: int) -> list[int]:
    """The ranks whose rendezvous keys a store timeout lists (``keys: /.../2``):
    each key ends in the rank that should have written it; [] if none is listed."""
    if "keys:" not in text:
        return []
    found = re.findall(r"/(\d+)(?=[\s,\]]|$)", text.split("keys:", 1)[1])
    return sorted({int(r) for r in found if int(r) < size and int(r) != me})
