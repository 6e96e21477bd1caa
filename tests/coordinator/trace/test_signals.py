"""GROUPCOORD_TRACE_SIGNAL: the value checked, and a real process dumping on ``os.kill``
while the application's own handler still runs."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import pytest

from coordinator.trace import signals

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("value", "want"), [
    ("SIGUSR1", signal.SIGUSR1), ("usr2", signal.SIGUSR2), (str(int(signal.SIGUSR1)),
                                                            signal.SIGUSR1), ("", None),
])
def test_the_signal_is_named_or_numbered(monkeypatch: pytest.MonkeyPatch, value: str,
                                         want: Any) -> None:
    monkeypatch.setenv(signals.SIGNAL_ENV, value)
    assert signals.signal_from_env() == want


@pytest.mark.parametrize("value", ["SIGNOPE", "99999", "-3", "0", "USR 1"])
def test_an_unknown_signal_raises_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                      value: str) -> None:
    monkeypatch.setenv(signals.SIGNAL_ENV, value)
    with pytest.raises(ValueError, match=signals.SIGNAL_ENV):
        signals.signal_from_env()


def test_nothing_is_installed_off_the_main_thread(caplog: pytest.LogCaptureFixture) -> None:
    got: list[Any] = []
    before = signal.getsignal(signal.SIGUSR2)
    with caplog.at_level(logging.WARNING, logger="coordinator.trace.signals"):
        t = threading.Thread(target=lambda: got.append(signals.install(signal.SIGUSR2)))
        t.start()
        t.join()
    assert got == [None] and signals.installed() is None
    assert signal.getsignal(signal.SIGUSR2) is before
    assert "main thread" in caplog.text


def dump_on_kill(rank: int, world_size: int, directory: str, app_handler: bool) -> dict[str, Any]:
    """Create a group with GROUPCOORD_TRACE_SIGNAL=SIGUSR1 set, make a call, then
    ``os.kill`` this process with SIGUSR1; the handler runs on this (main) thread."""
    import torch

    from coordinator import GroupCoordinator
    from coordinator.trace.recorder import reset_recorder

    original = signal.getsignal(signal.SIGUSR1)
    seen: list[int] = []
    signal.signal(signal.SIGUSR1, (lambda s, f: seen.append(s)) if app_handler
                  else signal.SIG_DFL)
    os.environ[signals.SIGNAL_ENV] = "SIGUSR1"
    os.environ["GROUPCOORD_TRACE_DUMP"] = os.path.join(directory, "rank_")
    previous = reset_recorder()
    g = None
    try:
        g = GroupCoordinator([[0]], 0, "gloo", True, group_name="sigdump")
        assert signals.installed() == signal.SIGUSR1
        g.all_reduce(torch.ones(2))
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(1000):  # the handler runs between bytecodes of this thread
            if os.path.exists(os.path.join(directory, "rank_0")):
                break
        import pickle

        with open(os.path.join(directory, "rank_0"), "rb") as f:
            dump = pickle.load(f)
        return {"ops": [e["op"] for e in dump["entries"]], "seen": seen,
                "reason": dump["groupcoord"]["reason"]}
    finally:
        if g is not None:
            g.destroy()
        signals.uninstall()
        signal.signal(signal.SIGUSR1, original)
        os.environ.pop(signals.SIGNAL_ENV, None)
        os.environ.pop("GROUPCOORD_TRACE_DUMP", None)
        reset_recorder(previous)


@pytest.mark.parametrize("app_handler", [True, False])
def test_a_signal_dumps_and_the_application_handler_still_runs(dist_pool, tmp_path,
                                                                app_handler: bool) -> None:
    out = dist_pool(1).run(dump_on_kill, str(tmp_path), app_handler, timeout=30)[0]
    assert out["ops"] == ["all_reduce"]
    assert out["reason"] == "signal SIGUSR1"
    assert out["seen"] == ([int(signal.SIGUSR1)] if app_handler else [])


@pytest.mark.parametrize("value", ["SIGKILL", "kill", str(int(signal.SIGKILL)), "SIGSTOP",
                                   str(int(signal.SIGSTOP))])
def test_an_uncatchable_signal_raises_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                          value: str) -> None:
    monkeypatch.setenv(signals.SIGNAL_ENV, value)
    with pytest.raises(ValueError, match=f"{signals.SIGNAL_ENV}.*cannot be caught"):
        signals.signal_from_env()


def test_install_never_chains_to_itself_and_uninstall_stays_on_the_main_thread() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    try:
        assert signals.install(signal.SIGUSR2) == signal.SIGUSR2
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(signals.uninstall()))
        t.start()
        t.join()
        assert got == [False] and signals.installed() == signal.SIGUSR2  # left as it was
        assert signal.getsignal(signal.SIGUSR2) is signals._handler
        signals._installed = None  # as an uninstall that could not restore it left it
        assert signals.install(signal.SIGUSR2) == signal.SIGUSR2
        assert signals._installed is not None and signals._installed[1] is None
    finally:
        assert signals.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    signal.signal(signal.SIGUSR2, before)
