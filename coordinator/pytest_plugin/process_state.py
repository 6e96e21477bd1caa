"""What a test may change in a reused rank process, saved before the test and put
back after it, so that the next test on the rank starts as on a fresh one.

Put back: the environment variables, the working directory, ``sys.path``,
``sys.modules`` entries the test replaced or removed (and entries it added that
are not modules at all, such as a mock a test put there: a module object it added
stays, as libraries add lazily loaded modules of their own), the
warnings filters, handlers the test set on signals (except the library's own
exit handlers, which it installs when a rank first creates shared memory),
timers the test started and left running (``signal.setitimer``/``alarm`` of
each kind, ``faulthandler.dump_traceback_later``: each would fire during a
later test, and with its handler put back to the default end the rank), and
torch's default dtype and device, grad mode, deterministic-algorithms flag,
intra-op thread count, and the random states of torch's CPU generator,
:mod:`random` and ``numpy.random``.

Not put back (see docs/pytest_plugin.md): module globals and caches, modules
the test imported, torch's inter-op thread count (fixed once used), logging
configuration, threads and child processes the test left running, process
groups other than the layout's (``dist.new_group``).
"""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["ProcessState"]

#: Modules whose signal handlers are the library's (installed lazily), kept.
_LIBRARY = ("shm_broadcast.", "coordinator.", "device_comms.", "torch.")
_UNSETTABLE = {signal.SIGKILL, signal.SIGSTOP}
_TIMERS = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)


class ProcessState:
    """A snapshot of what :meth:`restore` puts back (taken by :meth:`save`)."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.modules = dict(sys.modules)
        # warnings' own save and restore (it tells the C warnings cache of the change)
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        self.handlers = {s: signal.getsignal(s) for s in signal.valid_signals()
                         if s not in _UNSETTABLE}
        self.idle_timers = [which for which in _TIMERS if signal.getitimer(which) == (0.0, 0.0)]
        self.random = random.getstate()
        self.torch = _TorchState() if "torch" in sys.modules else None
        np = sys.modules.get("numpy")
        self.numpy = np.random.get_state() if np is not None else None

    @classmethod
    def save(cls) -> ProcessState:
        """What the process is now."""
        return cls()

    def restore(self) -> None:
        """Put the process back as it was when saved."""
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        sys.path[:] = self.path
        self._restore_modules()
        self.warnings.__exit__(None, None, None)
        self._stop_timers()  # before the handlers: a default one would end the process
        self._restore_handlers()
        random.setstate(self.random)
        if self.torch is not None:
            self.torch.restore()
        np = sys.modules.get("numpy")
        if np is not None and self.numpy is not None:
            np.random.set_state(self.numpy)

    def _restore_modules(self) -> None:
        now = sys.modules
        for name, mod in self.modules.items():
            if now.get(name) is not mod:
                now[name] = mod
        for name in [n for n, m in now.items() if n not in self.modules and not _is_module(m)]:
            del now[name]

    def _stop_timers(self) -> None:
        """Stop the interval timers that were idle when saved, and faulthandler's
        timer (the rank process never arms one of its own)."""
        for which in self.idle_timers:
            if signal.getitimer(which) != (0.0, 0.0):
                signal.setitimer(which, 0.0)
        faulthandler.cancel_dump_traceback_later()

    def _restore_handlers(self) -> None:
        for sig, before in self.handlers.items():
            now = signal.getsignal(sig)
            if now is before or now == before or before is None:  # None: set outside Python
                continue
            if before == signal.SIG_DFL and _library_handler(now):
                continue
            signal.signal(sig, before)


def _is_module(value: Any) -> bool:
    """Whether ``value`` is a module object (imported, or made by a library or a test)."""
    return isinstance(value, ModuleType)


def _library_handler(handler: Any) -> bool:
    module = getattr(handler, "__module__", None) or ""
    return module.startswith(_LIBRARY) or module in {p.rstrip(".") for p in _LIBRARY}


class _TorchState:
    """torch's process-wide settings and its CPU generator's state."""

    def __init__(self) -> None:
        import torch

        self.dtype = torch.get_default_dtype()
        self.device = torch.get_default_device() if hasattr(torch, "get_default_device") else None
        self.grad = torch.is_grad_enabled()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.threads = torch.get_num_threads()
        self.rng = torch.get_rng_state()

    def restore(self) -> None:
        import torch

        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        if self.device is not None and torch.get_default_device() != self.device:
            # cpu is also what no default device gives: None removes the test's
            torch.set_default_device(None if self.device.type == "cpu" else self.device)
        torch.set_grad_enabled(self.grad)
        if torch.are_deterministic_algorithms_enabled() != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        torch.set_rng_state(self.rng)
