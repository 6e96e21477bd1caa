"""Calls of a layout the communicator checked before: what they may skip.

The public methods of :class:`~device_comms.base.DeviceCommunicator` check
every argument before anything is sent, so that a bad call raises on every
rank. At decode-step sizes those checks cost more than the shared-memory step
itself (about 10 us against 5 us for a 4 KiB all-gather at world size 2), and
a serving engine repeats the same few layouts every step.

What the checks conclude from a call's *layout* alone (its op, dtype, shape
and ``dim``) is the same for every call of that layout: the normalised
``dim``, that the result fits in memory, that ``dim`` divides among the ranks,
and the size key the ranks' steps compare. The checked path records these as
a :class:`LayoutPlan` once it has accepted a call (:class:`LayoutPlans`).
What depends on the *tensor object* (its type, device, layout, strides,
autograd flag, storage and address) can change between calls of one layout,
so :func:`plain` and :func:`takes_out` check it on every call before a plan
is used; a call that fails them takes the checked path, which says what is
wrong and tells the peers.
"""

from __future__ import annotations

from typing import Any, Generic, NamedTuple, TypeVar

import torch

from device_comms.validation import storage_covers

__all__ = ["KeptLayouts", "LayoutPlan", "LayoutPlans", "plain", "takes_out", "apart",
           "writable"]

_PLAIN_TENSOR = torch.Tensor  # exactly this type: no subclass (Parameter, FakeTensor)
_STRIDED = torch.strided
_PLANS_MAX = 256  # layouts kept; a caller's layouts are few, and a full table starts again
_K = TypeVar("_K")
_V = TypeVar("_V")


class LayoutPlan(NamedTuple):
    """What the checks concluded about one layout (op, dtype, shape, ``dim``).

    Attributes:
        dim: ``dim`` normalised (non-negative).
        size_key: The key the ranks' steps compare for this layout.
        result_shape: The shape of the call's result.
    """

    dim: int
    size_key: int
    result_shape: torch.Size


class KeptLayouts(Generic[_K, _V]):
    """What a communicator's checked path concluded about the layouts it accepted, by a
    layout key: at most ``limit`` entries (a caller's layouts are few; a full table
    starts again).

    Attributes:
        get: ``get(key)``: the kept value, or None (a plain dict lookup: fast paths
            call it on every call).
    """

    __slots__ = ("get", "_table", "_limit")

    def __init__(self, limit: int = _PLANS_MAX) -> None:
        self._table: dict[_K, _V] = {}
        self._limit = limit
        self.get = self._table.get

    def keep(self, key: _K, value: _V) -> None:
        """Keep ``value`` for ``key``."""
        table = self._table
        if len(table) >= self._limit:
            table.clear()
        table[key] = value

    def clear(self) -> None:
        """Forget every entry."""
        self._table.clear()


class LayoutPlans:
    """The plans of the layouts a communicator's checked path accepted, by op."""

    __slots__ = ("_plans",)

    def __init__(self) -> None:
        self._plans: KeptLayouts[tuple[str, torch.dtype, torch.Size, int], LayoutPlan] = (
            KeptLayouts())

    def get(self, op: str, t: torch.Tensor, dim: int) -> LayoutPlan | None:
        """The plan of ``op`` on ``t``'s dtype and shape along ``dim``, if one was kept."""
        return self._plans.get((op, t.dtype, t.shape, dim))

    def keep(self, op: str, t: torch.Tensor, dim: int, plan: LayoutPlan) -> None:
        """Keep ``plan`` for ``op`` on ``t``'s dtype and shape along ``dim`` (as the
        caller passed it: ``-1`` and ``ndim - 1`` are two entries)."""
        self._plans.keep((op, t.dtype, t.shape, dim), plan)

    def clear(self) -> None:
        """Forget every plan."""
        self._plans.clear()


def plain(t: Any) -> bool:
    """Whether ``t`` is what the engine reads and writes by address without further
    checks: exactly a ``torch.Tensor`` (no subclass), dense, on the CPU, contiguous,
    not requiring grad, its bytes its values (no lazy negation or conjugation, not a
    storage-less zero tensor), its storage covering its elements."""
    return (
        type(t) is _PLAIN_TENSOR
        and t.is_cpu
        and t.layout is _STRIDED  # before is_contiguous: sparse has no strides
        and not t.is_nested
        and not t.requires_grad
        and t.is_contiguous()
        and not t.is_neg()
        and not t.is_conj()
        and not t._is_zerotensor()  # noqa: SLF001 - torch's own API, no public one
        and storage_covers(t)
    )


def apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether contiguous ``a`` and ``b`` span disjoint bytes."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 + a.nbytes <= b0 or b0 + b.nbytes <= a0


def writable(t: torch.Tensor) -> bool:
    """Whether torch lets a call write into ``t`` here: not an inference tensor
    outside ``torch.inference_mode()``."""
    return not t.is_inference() or torch.is_inference_mode_enabled()


def takes_out(out: Any, input_: torch.Tensor, shape: torch.Size) -> bool:
    """Whether ``out`` may take a result of ``shape`` computed from ``input_`` (for
    which :func:`plain` already holds) without further checks: :func:`plain`,
    :func:`writable`, ``input_``'s dtype, ``shape``, and no byte shared with ``input_``."""
    return (
        plain(out)
        and writable(out)
        and out.dtype is input_.dtype
        and out.shape == shape
        and apart(out, input_)
    )
