"""``ProcessState`` alone, in this process: what a test changes is put back."""

from __future__ import annotations

import os
import random
import signal
import sys
import types
import warnings

import torch

from coordinator.pytest_plugin.process_state import ProcessState


def test_what_a_test_changes_is_put_back() -> None:
    before_handler = signal.getsignal(signal.SIGUSR1)
    real = sys.modules["json"] if "json" in sys.modules else __import__("json")
    saved = ProcessState.save()
    draws = (torch.rand(2).tolist(), random.random())
    try:
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        signal.signal(signal.SIGUSR1, lambda *_: None)
        sys.modules["json"] = types.ModuleType("json")  # a stand-in over a real module
        sys.modules["process_state_stand_in"] = object()  # a mock, say: not a module
        warnings.simplefilter("error")
        os.environ["PROCESS_STATE_TEST"] = "1"
    finally:
        saved.restore()
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    assert signal.getsignal(signal.SIGUSR1) is before_handler
    assert sys.modules["json"] is real and "process_state_stand_in" not in sys.modules
    assert not any(f[0] == "error" and f[2] is Warning for f in warnings.filters[:1])
    assert "PROCESS_STATE_TEST" not in os.environ
    assert (torch.rand(2).tolist(), random.random()) == draws  # the same draws again


def test_timers_the_test_left_running_are_stopped() -> None:
    # ITIMER_REAL is pytest-timeout's in this process (the pool's test covers it in a rank)
    before = signal.getsignal(signal.SIGPROF)
    saved = ProcessState.save()
    try:
        signal.signal(signal.SIGPROF, lambda *_: None)
        signal.setitimer(signal.ITIMER_PROF, 30.0)
        signal.setitimer(signal.ITIMER_VIRTUAL, 30.0)
    finally:
        saved.restore()
    try:
        assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
        assert signal.getitimer(signal.ITIMER_VIRTUAL) == (0.0, 0.0)
        assert signal.getsignal(signal.SIGPROF) is before
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0.0)
        signal.setitimer(signal.ITIMER_VIRTUAL, 0.0)


def _library_exit_handler(signum: int, frame: object) -> None:
    """Stands for the library's exit handler (installed when shared memory is made)."""


_library_exit_handler.__module__ = "shm_broadcast.lifecycle.exit_cleanup"


def test_the_library_s_own_exit_handlers_stay() -> None:
    sig = signal.SIGUSR1
    before = signal.getsignal(sig)
    signal.signal(sig, signal.SIG_DFL)
    try:
        saved = ProcessState.save()
        signal.signal(sig, _library_exit_handler)
        saved.restore()
        assert signal.getsignal(sig) is _library_exit_handler
    finally:
        signal.signal(sig, before)
