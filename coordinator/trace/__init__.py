"""The flight recorder: what every group call did, dumps readable by PyTorch's
``torchfrtrace``, the ``groupcoord trace`` analysis, and the watchdog of device calls.

* :mod:`coordinator.trace.recorder`: the per-process ring of calls;
* :mod:`coordinator.trace.dump`: dumps in PyTorch's flight-recorder format.
"""

from __future__ import annotations

from coordinator.trace.dump import snapshot, write_dump
from coordinator.trace.recorder import FlightRecorder, GroupTrace, recorder, reset_recorder

__all__ = ["FlightRecorder", "GroupTrace", "recorder", "reset_recorder", "snapshot",
           "write_dump"]
