"""Functions the pool tests send to ranks as tests (by module and name)."""

from __future__ import annotations

import os
import time


def passes(rank: int, group: object) -> None:
    import torch

    assert group.all_reduce(torch.ones(1)).item() == 2  # type: ignore[attr-defined]


def fails_on_rank_1(rank: int) -> None:
    assert rank != 1, "rank 1 refuses"


def sleeps_on_rank_0(rank: int) -> None:
    if rank == 0:
        time.sleep(60)


def fails_on_rank_1_before_a_barrier(rank: int, group: object) -> None:
    assert rank != 1, "rank 1 refuses"
    group.barrier()  # type: ignore[attr-defined]  # rank 0 waits here for rank 1


def prints(rank: int) -> None:
    import os

    # file descriptors: in a rank print() writes there too; in a test's own
    # process sys.stdout is pytest's
    os.write(1, f"stdout of rank {rank}\n".encode())
    os.write(2, b"raw stderr\n")


def skips(rank: int) -> None:
    import pytest

    pytest.skip(f"not on rank {rank}")


def wants_the_tp_group(tp_group: object) -> None:
    raise AssertionError("never called: no model-parallel groups here")


async def is_a_coroutine(rank: int) -> None:
    raise AssertionError("never awaited")


def starts_a_child_then_waits(rank: int, pid_file: str) -> None:
    import subprocess

    if rank == 0:
        child = subprocess.Popen(["sleep", "60"])  # left running, in the rank's group
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(child.pid))
        os.rename(pid_file + ".tmp", pid_file)
    time.sleep(60)


def changes_process_state(rank: int, tmp: str) -> None:
    import random
    import signal
    import sys

    import torch

    with open(os.path.join(tmp, f"draw{rank}"), "w") as f:
        f.write(repr((torch.rand(1).item(), random.random())))
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(torch.get_num_threads() + 1)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    sys.modules["plugin_test_stand_in"] = object()  # a mock, say: not a module
    sys.path.append("/plugin-test-path")
    os.environ["PLUGIN_TEST_LEFT"] = "1"
    os.chdir("/")
    # Timers left running: each would end the process during the next test
    import faulthandler

    signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    signal.setitimer(signal.ITIMER_PROF, 0.5)  # SIGPROF's default action ends the process
    faulthandler.dump_traceback_later(0.5, exit=True)


def sees_the_process_state_as_before(rank: int, tmp: str, threads: int) -> None:
    import random
    import signal
    import sys

    import torch

    with open(os.path.join(tmp, f"draw{rank}")) as f:
        assert (torch.rand(1).item(), random.random()) == eval(f.read())  # the same draws
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    assert torch.get_num_threads() == threads
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    assert "plugin_test_stand_in" not in sys.modules and "/plugin-test-path" not in sys.path
    assert "PLUGIN_TEST_LEFT" not in os.environ and os.getcwd() != "/"
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    time.sleep(1.0)  # past the faulthandler timer the last test set


def thread_count(rank: int, tmp: str) -> None:
    import torch

    with open(os.path.join(tmp, f"threads{rank}"), "w") as f:
        f.write(str(torch.get_num_threads()))


class WithSetup:
    """A test class with xunit-style setup (pytest makes one instance per test)."""

    def setup_method(self, method: object) -> None:
        self.ready = getattr(method, "__name__", "")

    def teardown_method(self, method: object) -> None:
        os.write(1, f"teardown_method after {getattr(method, '__name__', '')}\n".encode())

    def test_uses_setup(self, rank: int) -> None:
        assert self.ready == "test_uses_setup"
