"""Traceable collectives: ``groupcoord::all_reduce``, ``all_gather``, ``reduce_scatter``.

``torch.compile`` cannot trace into a process-group call (Python objects,
sockets, C++ work handles), so a plain collective inside a compiled module
would split the graph. Registering each collective as a torch custom op makes
it one opaque node instead: Dynamo records the call, the *fake* implementation
tells the compiler the output's shape and dtype without communicating, and at
run time the *real* implementation looks up the
:class:`~coordinator.group.group_coordinator.GroupCoordinator` by its unique name
and runs its ordinary (eager) collective.

The group travels through the graph as a string (its ``unique_name``), since
graph inputs must be tensors or plain values. Groups register themselves in
:mod:`coordinator.group.registry`, a weak-value mapping, so a compiled graph
never keeps a destroyed group alive.

Eager code does not pay for any of this: ``GroupCoordinator.all_reduce`` calls
these ops only while ``torch.compiler.is_compiling()`` (i.e. while Dynamo
traces); when the compiled graph later *runs*, that flag is false again and
the op's implementation takes the eager path of the same method.

Schemas (all return new tensors, nothing is mutated)::

    groupcoord::all_reduce(Tensor tensor, str group_name) -> Tensor
    groupcoord::all_gather(Tensor tensor, int dim, int world_size, str group_name) -> Tensor
    groupcoord::reduce_scatter(Tensor tensor, int dim, int world_size, str group_name) -> Tensor

``world_size`` is passed explicitly so the fake implementations can compute
output shapes without looking the group up.

Autograd (so compiled training-style graphs get a backward graph); each
formula is the adjoint of its collective, computed with the other ops::

    all_reduce(x)                 backward: all_reduce(grad)
    all_gather(x, dim)            backward: reduce_scatter(grad, dim)
    reduce_scatter(x, dim)        backward: all_gather(grad, dim)

These are gradients of the *global* loss (the sum of every rank's loss): e.g.
``x_r`` contributes to the all-reduced output of every rank, so its gradient
sums every rank's output gradient. Every rank must run the backward, in the
same order, like any collective. Only the ops carry these formulas:
``GroupCoordinator.all_reduce`` in eager mode stays non-differentiable (as in
``torch.distributed``); under ``torch.compile`` it traces to the op, so
compiled code backpropagates through it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch.library import custom_op

try:  # torch's own lazy torch.compiler.disable (see untraced)
    from torch._compile import _disable_dynamo as _lazy_disable
except ImportError:  # pragma: no cover - a torch without it wraps eagerly
    _lazy_disable = None  # type: ignore[assignment]

from device_comms.validation import norm_dim

__all__ = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "traced_all_reduce",
    "traced_all_gather",
    "traced_reduce_scatter",
    "traced_alone",
    "tracing",
    "outside_graph",
    "untraced",
]


def _lookup(group_name: str) -> Any:
    from coordinator.group.registry import get_group_by_name  # lazy: no import cycle

    return get_group_by_name(group_name)


def _fresh(out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """Custom ops must not return (a view of) their input: copy if the group did."""
    if out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr():
        return out.clone()
    return out


def _scaled_shape(t: torch.Tensor, dim: int, world_size: int, grow: bool) -> list[Any]:
    shape = list(t.shape)
    d = dim % t.dim()
    if grow:
        shape[d] = shape[d] * world_size
    else:
        torch._check(  # noqa: SLF001 - torch's own shape check, understood by the compiler
            shape[d] % world_size == 0,
            lambda: f"reduce_scatter: size {shape[d]} of dim {d} is not divisible by {world_size}",
        )
        shape[d] = shape[d] // world_size
    return shape


@custom_op("groupcoord::all_reduce", mutates_args=())
def all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum ``tensor`` over the group named ``group_name`` (new tensor)."""
    return _fresh(_lookup(group_name)._all_reduce_out_place(tensor), tensor)  # noqa: SLF001 - the seed's eager body


@all_reduce.register_fake
def _all_reduce_fake(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


@custom_op("groupcoord::all_gather", mutates_args=())
def all_gather(tensor: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (new tensor)."""
    return _fresh(_lookup(group_name)._all_gather_out_place(tensor, dim), tensor)  # noqa: SLF001


@all_gather.register_fake
def _all_gather_fake(
    tensor: torch.Tensor, dim: int, world_size: int, group_name: str
) -> torch.Tensor:
    return tensor.new_empty(_scaled_shape(tensor, dim, world_size, grow=True))


@custom_op("groupcoord::reduce_scatter", mutates_args=())
def reduce_scatter(
    tensor: torch.Tensor, dim: int, world_size: int, group_name: str
) -> torch.Tensor:
    """Sum over the group and keep this rank's equal slice along ``dim`` (new tensor)."""
    return _fresh(_lookup(group_name)._reduce_scatter_out_place(tensor, dim), tensor)  # noqa: SLF001


@reduce_scatter.register_fake
def _reduce_scatter_fake(
    tensor: torch.Tensor, dim: int, world_size: int, group_name: str
) -> torch.Tensor:
    return tensor.new_empty(_scaled_shape(tensor, dim, world_size, grow=False))


# --------------------------------------------------------------------------- helpers
def traced_all_reduce(group: Any, tensor: torch.Tensor) -> torch.Tensor:
    """Call ``groupcoord::all_reduce`` for ``group`` (anything with ``unique_name``)."""
    out: torch.Tensor = torch.ops.groupcoord.all_reduce(tensor, group.unique_name)
    return out


def tracing() -> bool:
    """True while torch.compile traces: a group's collectives become these custom
    ops, opaque graph nodes whose implementation calls back into the eager path."""
    return torch.compiler.is_compiling()


_F = TypeVar("_F", bound=Callable[..., Any])


def untraced(fn: _F) -> _F:
    """``fn`` as ``torch.compiler.disable`` makes it, with Dynamo imported at its first call.

    Called while torch.compile traces, the result is a graph break and ``fn``
    runs as in eager mode. ``torch.compiler.disable`` imports Dynamo when it
    wraps, which costs every process that imports this library 1.3-1.5 s of
    CPU (docs/performance.md, "Import time"); torch's own lazy form
    (``torch._compile._disable_dynamo``, in a module Dynamo never traces into)
    wraps at the first call instead, which only comes while Dynamo traces.
    """
    if _lazy_disable is None:
        return cast(_F, torch.compiler.disable(fn))
    return cast(_F, _lazy_disable(fn))


def outside_graph(method: _F) -> _F:
    """A group method with no custom op, run eagerly while torch.compile traces.

    The tracer must not follow such a call into the library's waits, queues and
    address arithmetic: fake tensors of dynamic shapes cannot take them (a
    recompile for a new batch size failed there on the rank that sends, and its
    peers waited). While tracing, the call goes through :func:`untraced`: a
    graph break, with the call run as in eager mode. Outside tracing it costs
    one check.
    """
    eager = untraced(method)

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return eager(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return cast(_F, call)


def traced_alone(input_: torch.Tensor, dim: int) -> torch.Tensor:
    """A world-size-1 gather or scatter under torch.compile: this rank's data (a
    new tensor, as in eager mode), with ``dim`` checked as in eager mode."""
    norm_dim(dim, input_.dim())
    return input_.clone()


def traced_all_gather(group: Any, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Call ``groupcoord::all_gather`` for ``group`` (needs ``unique_name``, ``world_size``)."""
    out: torch.Tensor = torch.ops.groupcoord.all_gather(
        tensor, norm_dim(dim, tensor.dim()), group.world_size, group.unique_name
    )
    return out


def traced_reduce_scatter(group: Any, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Call ``groupcoord::reduce_scatter`` for ``group`` (needs ``unique_name``, ``world_size``)."""
    out: torch.Tensor = torch.ops.groupcoord.reduce_scatter(
        tensor, norm_dim(dim, tensor.dim()), group.world_size, group.unique_name
    )
    return out


# --------------------------------------------------------------------------- autograd
def _setup_dim_ws_name(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    _, ctx.dim, ctx.world_size, ctx.group_name = inputs


def _setup_name(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.group_name = inputs[1]


def _all_reduce_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return torch.ops.groupcoord.all_reduce(grad.contiguous(), ctx.group_name), None


def _all_gather_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
    g = torch.ops.groupcoord.reduce_scatter(
        grad.contiguous(), ctx.dim, ctx.world_size, ctx.group_name
    )
    return g, None, None, None


def _reduce_scatter_backward(
    ctx: Any, grad: torch.Tensor
) -> tuple[torch.Tensor, None, None, None]:
    g = torch.ops.groupcoord.all_gather(grad.contiguous(), ctx.dim, ctx.world_size, ctx.group_name)
    return g, None, None, None


all_reduce.register_autograd(_all_reduce_backward, setup_context=_setup_name)
all_gather.register_autograd(_all_gather_backward, setup_context=_setup_dim_ws_name)
reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_setup_dim_ws_name)
