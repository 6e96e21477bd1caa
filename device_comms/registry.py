"""Registry of device communicators, in the spirit of
``torch.distributed.Backend.register_backend``.

Communicator classes register under a name. :func:`select_device_communicator`
picks, for a device, the highest-priority registered class that serves that
device type and says ``is_available()``. Nothing here switches on strings or
environment variables: to add a transport, subclass
:class:`~device_comms.base.DeviceCommunicator` and register it.
"""

from __future__ import annotations

import threading

import torch

from device_comms import validation
from device_comms.base import DeviceCommunicator
from device_comms.errors import CommunicatorUnavailable

__all__ = [
    "register_device_communicator",
    "unregister_device_communicator",
    "get_device_communicator",
    "list_device_communicators",
    "select_device_communicator",
]


class _Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._classes: dict[str, type[DeviceCommunicator]] = {}

    def register(self, name: str, cls: type[DeviceCommunicator], override: bool) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if not (isinstance(cls, type) and issubclass(cls, DeviceCommunicator)):
            raise TypeError(f"cls must be a DeviceCommunicator subclass, got {cls!r}")
        with self._lock:
            if name in self._classes and self._classes[name] is not cls and not override:
                raise ValueError(
                    f"a device communicator named {name!r} is already registered "
                    f"({self._classes[name].__qualname__}); pass override=True to replace it"
                )
            self._classes[name] = cls

    def unregister(self, name: str) -> None:
        with self._lock:
            self._classes.pop(name, None)

    def get(self, name: str) -> type[DeviceCommunicator]:
        with self._lock:
            cls = self._classes.get(name)
            known = sorted(self._classes)
        if cls is None:
            raise CommunicatorUnavailable(
                f"no device communicator named {name!r}; registered: {known}"
            )
        return cls

    def items(self) -> list[tuple[str, type[DeviceCommunicator]]]:
        with self._lock:
            return list(self._classes.items())


_REGISTRY = _Registry()


def register_device_communicator(
    name: str, cls: type[DeviceCommunicator], override: bool = False
) -> None:
    """Register ``cls`` under ``name``.

    Args:
        name: Registry key.
        cls: A :class:`DeviceCommunicator` subclass.
        override: Replace an existing registration of the same name.

    Raises:
        TypeError: ``cls`` is not a DeviceCommunicator subclass.
        ValueError: ``name`` is taken and ``override`` is False.
    """
    _REGISTRY.register(name, cls, override)


def unregister_device_communicator(name: str) -> None:
    """Remove ``name`` from the registry (no error if absent)."""
    _REGISTRY.unregister(name)


def get_device_communicator(name: str) -> type[DeviceCommunicator]:
    """Return the class registered under ``name``.

    Raises:
        CommunicatorUnavailable: Nothing is registered under ``name``.
    """
    return _REGISTRY.get(name)


def list_device_communicators() -> dict[str, dict[str, object]]:
    """Describe every registered communicator (name -> devices, priority, available)."""
    return {
        name: {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "devices": sorted(cls.device_types),
            "priority": cls.priority,
            "available": _safe_available(cls),
        }
        for name, cls in _REGISTRY.items()
    }


def select_device_communicator(device: torch.device | str) -> type[DeviceCommunicator]:
    """Pick the best available communicator class for ``device``.

    Raises:
        CommunicatorUnavailable: No registered, available class serves the device type.
    """
    dev = validation.check_device(device)
    candidates = [
        cls for _, cls in _REGISTRY.items() if cls.serves(dev) and _safe_available(cls)
    ]
    if not candidates:
        raise CommunicatorUnavailable(
            f"no available device communicator serves device type {dev.type!r}; "
            f"registered: {list_device_communicators()}"
        )
    return max(candidates, key=lambda c: c.priority)


def _safe_available(cls: type[DeviceCommunicator]) -> bool:
    try:
        return bool(cls.is_available())
    except Exception:  # an availability probe must never break selection
        return False
