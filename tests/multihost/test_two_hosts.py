"""Two simulated hosts (network + mount + UTS + IPC + pid namespaces, a veth pair)
under ``torchrun --nnodes 2 --nproc-per-node 2``, with no topology hints.

What each test runs is in :mod:`tests.multihost.scenarios` (driver) and
:mod:`tests.multihost.ranks` (ranks); the same cases run from the command line
with ``python -m tests.multihost.scenarios`` (or ``run_two_hosts.sh``). Needs
root, ``ip netns`` and ``unshare``; skips with the reason elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.multihost import scenarios as sc
from tests.multihost.netns import TwoHosts, sweep_stale, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"two-host simulation: {REASON}")

#: The groups' timeout in the fault cases (seconds).
FAULT_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> sc.Run:
    """TP across the hosts and PP across the hosts, one torchrun launch."""
    return sc.run_healthy(tmp_path_factory.mktemp("healthy"))


@pytest.fixture(scope="module")
def fault_runs() -> dict[str, sc.Run]:
    """Fault runs by case name, each launched once per module."""
    return {}


def _fault_run(cache: dict[str, sc.Run], name: str, tmp: pytest.TempPathFactory) -> sc.Run:
    if name not in cache:
        cache[name] = sc.run_fault(tmp.mktemp(name), sc.FAULTS[name], FAULT_TIMEOUT)
    return cache[name]


# ---------------------------------------------------------------- healthy
@pytest.mark.timeout(150)
def test_tensor_parallel_across_hosts(healthy: sc.Run) -> None:
    """Node detection by shared-memory probe, CURVE TCP readers on the veth address,
    hierarchical all-reduce, exact collectives, result queues back across hosts."""
    assert not (missing := [r for r in range(4) if healthy.rank("tp", r) is None]), \
        f"no result from {missing}\n{healthy.describe()}"
    assert sc._check_tp(healthy, ("gchost-a", "gchost-b")) == []


@pytest.mark.timeout(150)
def test_pipeline_across_hosts(healthy: sc.Run) -> None:
    """TP over shared memory inside each host, tensor dicts and tensors across them."""
    assert not (missing := [r for r in range(4) if healthy.rank("pp", r) is None]), \
        f"no result from {missing}\n{healthy.describe()}"
    assert sc._check_pp(healthy) == []


@pytest.mark.timeout(150)
def test_hosts_exit_clean(healthy: sc.Run) -> None:
    """torchrun exits 0 on both hosts; no segment in either /dev/shm, nothing in /tmp."""
    assert sc._check_clean(healthy) == [], healthy.describe()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_hosts_with_the_same_hostname(tmp_path: Path) -> None:
    """Both hosts named ``gcnode`` (separate pid spaces): nothing may take the peer
    on the other host for a local process (a writer once declared a live TCP reader
    dead, reading the other host's pid in its own pid space)."""
    names, cases = ("gcnode", "gcnode"), ("tp",)
    run = sc.run_healthy(tmp_path, names, cases=cases)
    assert sc.check_healthy(run, names, cases) == [], run.describe()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env,expected", [
    ({"MASTER_ADDR": "10.213.0.1"}, "10.213.0.2"),
    ({}, "10.213.0.2"),
    # the override must be an address of host b: its loopback, which the route never gives
    ({"MASTER_ADDR": "10.213.0.1", "GROUPCOORD_HOST_IP": "127.0.0.1"}, "127.0.0.1"),
], ids=["master-addr", "hostname", "override"])
def test_host_ip_without_default_route(tmp_path: Path, env: dict[str, str],
                                       expected: str) -> None:
    """Host b has no default route: the queue's TCP endpoints must still bind on
    its veth address (from the route to MASTER_ADDR, else its resolved hostname),
    not on 127.0.0.1, which host a cannot reach; GROUPCOORD_HOST_IP overrides."""
    code = "from shm_broadcast.ranks.host_address import host_ip; print('HOST_IP=' + host_ip())"
    with TwoHosts(tmp_path) as hosts:
        launched = hosts.launch("b", [sys.executable, "-c", code], sc.host_env(env), 60,
                                cwd=str(sc.REPO))
        assert launched.wait(time.monotonic() + 90) == 0
        assert launched.command_status() == 0, launched.log_tail()
        assert f"HOST_IP={expected}\n" in launched.log_tail()


# ---------------------------------------------------------------- the demo
@pytest.mark.slow  # ~20 s; the CI keeps the cross-host TP, pipeline and fault cases
@pytest.mark.timeout(300)
def test_demo_tp2_pp2_across_hosts_equals_one_host(tmp_path: Path) -> None:
    """``torchrun ... -m coordinator demo --launcher env`` over both hosts: verified
    against the unsharded model, and the same tokens and bit-identical logits as
    the default one-host ``groupcoord demo``."""
    run, two = sc.run_demo_two_hosts(tmp_path / "two")
    one = sc.run_demo_one_host(tmp_path)
    assert sc.check_demo(run, two, one) == [], run.describe()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_tp4_across_hosts_equals_one_host(tmp_path: Path) -> None:
    """TP=4 over both hosts: every layer's all-reduce is hierarchical; tokens equal
    the one-host demo's and the logits pass the reference check."""
    run, two = sc.run_demo_two_hosts(tmp_path / "two", tp=4, pp=1)
    one = sc.run_demo_one_host(tmp_path, tp=4, pp=1)
    assert sc.check_demo(run, two, one, tp=4, pp=1, bitwise=False) == [], run.describe()


# ---------------------------------------------------------------- faults
_FAULT_PARAMS = [pytest.param(n, id=n) for n in sc.CI_CASES if n in sc.FAULTS] + [
    pytest.param(n, id=n, marks=pytest.mark.slow) for n in sc.SLOW_CASES if n in sc.FAULTS]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", _FAULT_PARAMS)
def test_fault_raises_within_the_timeout(name: str, fault_runs: dict[str, sc.Run],
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """A killed rank or a dropped link: every surviving rank raises one of our
    errors naming the op and a peer within timeout + 2 s, and leaves its groups."""
    run = _fault_run(fault_runs, name, tmp_path_factory)
    problems, times = sc.check_fault(run, sc.FAULTS[name], FAULT_TIMEOUT)
    assert problems == [], f"{problems}\ndetection times {times}\n{run.describe()}"
    assert set(times) >= set(sc.FAULTS[name].survivors())


@pytest.mark.timeout(150)
def test_link_down_is_a_timeout_not_a_death(fault_runs: dict[str, sc.Run],
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """Nobody died when the link dropped: every rank whose wait crosses the link
    raises a timeout (the TCP readers 2, 3 waiting for the writer, rank 0 waiting
    for leader rank 2), never PeerDiedError. Rank 1 waits for rank 0 on its own
    host, which may really have exited after its own timeout by then."""
    run = _fault_run(fault_runs, "fault-tp-link", tmp_path_factory)
    got = {r: (x.get("error_type"), x.get("message", "")[:300])
           for r, x in run.results.get("fault", {}).items()}
    assert sorted(got) == [0, 1, 2, 3], got
    for r in (0, 2, 3):
        assert "CommTimeout" in run.rank("fault", r)["error_mro"], got[r]
    assert got[1][0] in ("CommTimeout", "PeerDiedError", "ClosedError"), got[1]


# ---------------------------------------------------------------- clean-up
def _start_driver(argv: list[str], early: bool, log: Path) -> tuple[Any, int]:
    """Start a scenario driver (its output to ``log``); return it and the Python
    driver's pid once its hosts start (``early``: as soon as the first one is
    being created) or run."""
    import subprocess

    import psutil

    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=str(sc.REPO), env=sc.host_env(),
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            kids = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            break
        names = [_name(k) for k in kids]
        driver = next((k.pid for k in [psutil.Process(proc.pid), *kids]
                       if "tests.multihost.scenarios" in _cmdline(k)), None)
        started = sum(n in ("nsenter", "unshare") for n in names)
        if driver is not None and started >= (1 if early else 2) \
                and (early or "sh" in names):
            return proc, driver
        time.sleep(0.005 if early else 0.05)
    proc.kill()
    proc.wait()
    raise AssertionError("the driver's hosts never came up")


def _name(p: Any) -> str:
    try:
        return str(p.name())
    except Exception:
        return ""


def _cmdline(p: Any) -> str:
    try:
        return " ".join(p.cmdline())
    except Exception:
        return ""


def _wait_or_explain(proc: Any, driver: int, timeout: float, log: Path) -> None:
    """Wait for ``proc`` to exit; past ``timeout``, fail with what every process of
    its tree and the driver's was doing (state, kernel wait channel, command line;
    the driver's Python stacks, which it prints on SIGUSR1, in ``log``), after
    killing them all."""
    import signal
    import subprocess

    import psutil

    try:
        proc.wait(timeout)
        return
    except subprocess.TimeoutExpired:
        pass
    tree: dict[int, Any] = {}
    for root in (proc.pid, driver):
        try:
            top = psutil.Process(root)
            tree.update((p.pid, p) for p in [top, *top.children(recursive=True)])
        except psutil.NoSuchProcess:
            pass
    rows = []
    for pid, p in sorted(tree.items()):
        try:
            with open(f"/proc/{pid}/wchan") as f:
                wchan = f.read().strip()
            rows.append(f"{pid} ppid {p.ppid()} {p.status()} wchan {wchan}: {_cmdline(p)[:160]}")
        except (OSError, psutil.Error):
            rows.append(f"{pid}: gone")
    if driver in tree:
        with contextlib.suppress(OSError):
            os.kill(driver, signal.SIGUSR1)
        time.sleep(0.5)
    for p in tree.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    proc.kill()
    proc.wait()
    output = log.read_text(errors="replace")[-6000:]
    raise AssertionError(f"{proc.args} still ran {timeout:g}s after the signal; processes:\n"
                         + "\n".join(rows) + f"\noutput (driver stacks last):\n{output}")


def _processes_of(driver: int) -> list[Any]:
    """Processes whose command line names the driver's work directory or namespaces."""
    import psutil

    tag = f"gcmh-{driver}-"
    return [p for p in psutil.process_iter() if tag in _cmdline(p)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["sigkill-driver", "sigkill-driver-while-starting",
                                 "sigterm-script"])
def test_everything_is_removed_when_the_run_is_killed(how: str, tmp_path: Path) -> None:
    """SIGKILL of the Python driver, also while its hosts are being created (its
    hosts die with it; the next run sweeps its namespaces and work directory),
    or SIGTERM of run_two_hosts.sh (its trap and the driver remove everything):
    no process, namespace, veth or work directory is left."""
    import signal

    import psutil

    if how.startswith("sigkill-driver"):
        argv = [sys.executable, "-m", "tests.multihost.scenarios", "--case", "healthy"]
    else:
        argv = ["bash", str(sc.REPO / "tests/multihost/run_two_hosts.sh"), "--case", "healthy"]
    log = tmp_path / "driver.log"
    proc, driver = _start_driver(argv, early=how.endswith("while-starting"), log=log)
    os.kill(proc.pid, signal.SIGTERM if how == "sigterm-script" else signal.SIGKILL)
    _wait_or_explain(proc, driver, 30, log)
    # 5 s: far less than the run itself would take, so nothing may just finish
    deadline = time.monotonic() + 5
    while (left_procs := _processes_of(driver)) and time.monotonic() < deadline:
        psutil.wait_procs(left_procs, timeout=0.2)
    assert left_procs == [], [(p.pid, _cmdline(p)[:200]) for p in left_procs]
    if how.startswith("sigkill-driver"):
        sweep_stale()  # what the next run does first
    assert sorted(p.name for p in Path("/run/netns").glob(f"gcmh-{driver}-*")) == []
    assert sorted(Path(tempfile.gettempdir()).glob(f"gcmh-{driver}-*")) == []


def test_no_namespace_left_behind() -> None:
    """Every namespace this process created is gone (run last)."""
    sweep_stale()
    netns = Path("/run/netns")
    left = sorted(p.name for p in netns.glob(f"gcmh-{os.getpid()}-*")) if netns.is_dir() else []
    assert left == []
