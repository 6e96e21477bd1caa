"""Element-wise reduction of several tensors in a fixed (rank) order, into any output.

Same arithmetic as :func:`device_comms.reduce_op.reduce_local` (left to right,
``bool`` SUM/PRODUCT as logical OR/AND, AVG divides the sum once at the end),
so a shared-memory collective whose ranks all run it on the same inputs gets
bitwise identical results, equal to the reference.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from device_comms.reduce_op import ReduceOp

__all__ = ["binary_fn", "reduce_views", "NUMPY_SUM", "NUMPY_ERRORS", "quiet_numpy_sum"]

_Binary = Callable[..., torch.Tensor]

#: dtypes whose SUM the shared-memory engine runs as ``numpy.add``: ``np.add`` plus
#: ``torch.from_numpy`` dispatch less than ``torch.add`` (measured in
#: docs/performance.md), and the element-wise IEEE/two's-complement sums are bitwise
#: the same as torch's.
NUMPY_SUM = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})

#: What numpy raises where torch is silent: it reports a float sum that
#: overflows or is invalid (``inf + -inf``) after writing the IEEE result (inf,
#: nan) into its output -- as a RuntimeWarning, or as a FloatingPointError
#: under ``np.seterr(all="raise")``. The engine's results must be torch's, with
#: no report: warnings attributed to the modules that call ``np.add`` are
#: ignored (below), and where a user's ``"error"`` filter comes first or
#: numpy is set to raise, call sites catch these: an ``out=`` call's output is
#: complete, an allocating one is redone by :func:`quiet_numpy_sum`.
NUMPY_ERRORS = (RuntimeWarning, FloatingPointError)
warnings.filterwarnings("ignore", category=RuntimeWarning,
                        module=r"device_comms\.cpu_shm\.(pair|small)\Z")


def quiet_numpy_sum(views: Sequence[Any], out: Any = None) -> Any:
    """``views[0] + views[1] + ...`` in order (into ``out`` if given) with numpy,
    without numpy's floating-point reports; only for the rare call whose
    report was raised (entering ``np.errstate`` costs more than the sum of a small
    message, so the common path does without it)."""
    with np.errstate(all="ignore"):
        acc = np.add(views[0], views[1], out=out)
        for v in views[2:]:
            np.add(acc, v, out=acc)
    return acc

_FNS: dict[ReduceOp, _Binary] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.BAND: torch.bitwise_and,
    ReduceOp.BOR: torch.bitwise_or,
    ReduceOp.BXOR: torch.bitwise_xor,
}
_BOOL_FNS: dict[ReduceOp, _Binary] = {
    ReduceOp.SUM: torch.logical_or,
    ReduceOp.AVG: torch.logical_or,
    ReduceOp.PRODUCT: torch.logical_and,
}


def binary_fn(op: ReduceOp, dtype: torch.dtype) -> _Binary:
    """The two-operand torch function (``fn(a, b, out=...)``) that accumulates ``op``."""
    if dtype == torch.bool:
        return _BOOL_FNS.get(op, _FNS[op])
    return _FNS[op]


def reduce_views(
    srcs: Sequence[torch.Tensor], op: ReduceOp, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Reduce ``srcs`` (at least two, same shape) left to right.

    Args:
        srcs: Operands in rank order.
        op: The reduction.
        out: Where to write (may not alias any source); a new tensor when None.

    Returns:
        The reduced tensor (``out`` when given).
    """
    fn = binary_fn(op, srcs[0].dtype)
    acc = fn(srcs[0], srcs[1]) if out is None else fn(srcs[0], srcs[1], out=out)
    for s in srcs[2:]:
        fn(acc, s, out=acc)
    if op is ReduceOp.AVG:
        acc.div_(len(srcs))
    return acc
