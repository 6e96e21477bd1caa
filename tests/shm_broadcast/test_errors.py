"""One exception family for the whole project, rooted in ``shm_broadcast.errors``."""

from __future__ import annotations

import inspect
import pickle

import pytest

import coordinator
import coordinator.errors as coord_errors
import device_comms
import device_comms.errors as dev_errors
import shm_broadcast
import shm_broadcast.errors as shm_errors
from shm_broadcast.errors import GroupCoordError

_MODULES = [shm_errors, dev_errors, coord_errors]
_CLASSES = sorted(
    {obj for m in _MODULES for obj in vars(m).values()
     if inspect.isclass(obj) and issubclass(obj, BaseException)},
    key=lambda c: c.__qualname__,
)
_BUILTINS = (TimeoutError, RuntimeError, ValueError, LookupError, OSError, ConnectionError)


@pytest.mark.parametrize("cls", _CLASSES, ids=lambda c: c.__qualname__)
def test_every_error_belongs_to_the_family_and_a_builtin(cls: type) -> None:
    if cls is GroupCoordError:
        assert cls.__mro__[1] is Exception
        return
    assert issubclass(cls, GroupCoordError)
    assert issubclass(cls, _BUILTINS), f"{cls.__name__} mixes in no builtin"


@pytest.mark.parametrize(
    "name",
    ["GroupCoordError", "CommTimeout", "PeerDiedError", "ClosedError", "CollectiveMismatch"],
)
def test_each_kind_is_one_class_in_every_layer(name: str) -> None:
    cls = getattr(shm_errors, name)
    for where in (shm_broadcast, device_comms, dev_errors, coordinator, coord_errors):
        assert getattr(where, name) is cls, f"{where.__name__}.{name}"


@pytest.mark.parametrize(
    "old, new",
    [
        (shm_errors.ShmBroadcastError, GroupCoordError),
        (shm_errors.QueueTimeout, shm_errors.CommTimeout),
        (shm_errors.QueueClosedError, shm_errors.ClosedError),
        (dev_errors.DeviceCommError, GroupCoordError),
        (dev_errors.CollectiveTimeout, shm_errors.CommTimeout),
        (dev_errors.CommunicatorClosed, shm_errors.ClosedError),
    ],
    ids=["ShmBroadcastError", "QueueTimeout", "QueueClosedError", "DeviceCommError",
         "CollectiveTimeout", "CommunicatorClosed"],
)
def test_older_names_are_the_same_classes(old: type, new: type) -> None:
    assert old is new


def test_context_survives_and_builtins_catch() -> None:
    e = shm_errors.CommTimeout("queue 'q': dequeue timed out", queue="q", side="reader 1",
                               peers=[0])
    assert (e.queue, e.side, e.peers) == ("q", "reader 1", (0,))
    with pytest.raises(TimeoutError):
        raise e
    rejected = shm_errors.PeerRejectedError("tp:0", "all_reduce", 2, "bad dtype")
    back = pickle.loads(pickle.dumps(rejected))
    assert isinstance(back, ValueError)
    assert (back.rank, back.op, back.peers) == (2, "all_reduce", (2,))
    assert str(back) == str(rejected)
