"""A handle's finishing step (a CUDA group's ``irecv_tensor_dict`` with an
``all_gather_group`` rebuilds its slices in it): run once, by the first wait that
sees the call succeed, on the waiting thread; later waits return or raise the same.

The handles wrap real point-to-point work items that ran on this thread.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from coordinator.p2p.channels import Work
from coordinator.p2p.handle import P2PHandle


def _done(result: Any = None, error: BaseException | None = None) -> Work:
    def fn() -> Any:
        if error is not None:
            raise error
        return result

    w = Work("irecv_tensor_dict", 1, 7, fn, (), errors=None)  # type: ignore[arg-type]
    w.run()
    return w


def test_the_step_runs_once_on_the_waiting_thread() -> None:
    runs: list[tuple[Any, int]] = []

    def finish(got: Any) -> Any:
        runs.append((got, threading.get_ident()))
        return {"rebuilt": got}

    h = P2PHandle(_done("slices"), 5.0, finish)
    assert h.is_completed()
    first = h.wait()
    assert first == {"rebuilt": "slices"} and h.wait(0) is first
    assert runs == [("slices", threading.get_ident())]


def test_a_failing_step_raises_the_same_error_at_every_wait() -> None:
    calls = []

    def finish(got: Any) -> Any:
        calls.append(got)
        raise ValueError("the all-gather failed")

    h = P2PHandle(_done("slices"), 5.0, finish)
    for _ in range(2):
        with pytest.raises(ValueError, match="all-gather failed"):
            h.wait()
    assert calls == ["slices"]


def test_a_failed_call_never_runs_the_step() -> None:
    h = P2PHandle(_done(error=KeyError("lost")), 5.0, lambda got: pytest.fail("ran"))
    with pytest.raises(KeyError):
        h.wait()


def test_threads_waiting_together_run_the_step_once() -> None:
    started = threading.Event()
    calls = []

    def finish(got: Any) -> Any:
        calls.append(got)
        started.wait(5)  # every thread is in wait() meanwhile
        return object()

    h = P2PHandle(_done("x"), 5.0, finish)
    got: list[Any] = []
    threads = [threading.Thread(target=lambda: got.append(h.wait())) for _ in range(4)]
    for t in threads:
        t.start()
    started.set()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and len(got) == 4 and all(g is got[0] for g in got)


def test_an_interrupted_step_runs_again_at_the_next_wait() -> None:
    tries = []

    def finish(got: Any) -> Any:
        tries.append(got)
        if len(tries) == 1:
            raise KeyboardInterrupt
        return "whole"

    h = P2PHandle(_done("slices"), 5.0, finish)
    with pytest.raises(KeyboardInterrupt):
        h.wait()
    assert h.wait() == "whole" and len(tries) == 2
