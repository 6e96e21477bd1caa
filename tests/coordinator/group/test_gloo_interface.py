"""A loopback world's gloo pairs listen on loopback only, whatever the host's name is.

torch's gloo listens on the address the host's name resolves to. The
namespace test gives the host a name that resolves to a network address
(10.77.0.1 on a veth pair of a private network namespace, as on a server) and
checks that a ``tcp://127.0.0.1`` world (its model-parallel groups included)
listens on loopback only, that the variable is never left set (children and
other groups of the process do not inherit the pin), and that a
``GLOO_SOCKET_IFNAME`` the user set is left as it is.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys

import psutil
import pytest

from coordinator.group import gloo_interface as gi
from coordinator.testing import run_distributed
from tests.child_env import ROOT, child_env


def _listening() -> list[str]:
    """The addresses this process listens on (TCP)."""
    return sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN})


def _world_rank(rank: int, world_size: int) -> dict:
    import torch

    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(world_size, 1)
    assert ps.get_tp_group().all_reduce(torch.ones(3)).tolist() == [float(world_size)] * 3
    during = os.environ.get(gi.GLOO_IFNAME_ENV)
    listening = _listening()
    ps.get_world_group().barrier()  # every rank looked before any tears down
    ps.destroy_distributed_environment()
    return {"during": during, "after": os.environ.get(gi.GLOO_IFNAME_ENV),
            "listening": listening}


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("10.77.0.1", False), ("192.0.2.7", False), ("", False)])
def test_loopback_hosts_get_the_loopback_interface(host: str, loopback: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gi.GLOO_IFNAME_ENV, raising=False)
    name = gi.gloo_interface_for(host)
    assert (name is not None) == loopback
    if loopback:
        assert name == gi.loopback_interface()
    with gi.pinned_gloo(name):
        assert os.environ.get(gi.GLOO_IFNAME_ENV) == name
    assert gi.GLOO_IFNAME_ENV not in os.environ


@pytest.mark.parametrize("preset", ["lo", "eth-user-choice"])
def test_a_variable_the_user_set_is_kept(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gi.GLOO_IFNAME_ENV, preset)
    assert gi.gloo_interface_for("127.0.0.1") is None
    with gi.pinned_gloo("lo"):
        assert os.environ[gi.GLOO_IFNAME_ENV] == preset
    assert os.environ[gi.GLOO_IFNAME_ENV] == preset


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_loopback_world_pins_gloo_while_it_lives(world_size: int) -> None:
    if gi.GLOO_IFNAME_ENV in os.environ:
        pytest.skip(f"{gi.GLOO_IFNAME_ENV} is set here, and a set variable is kept")
    for got in run_distributed(_world_rank, world_size):
        assert got["during"] is None and got["after"] is None, got  # never left set
        assert got["listening"], got
        assert all(ipaddress.ip_address(a).is_loopback for a in got["listening"]), got


NAMESPACE = r"""
set -e
ip link set lo up
ip link add gcv0 type veth peer name gcv1
ip addr add 10.77.0.1/24 dev gcv0
ip link set gcv0 up
ip link set gcv1 up
hostname gchost
printf '127.0.0.1 localhost\n10.77.0.1 gchost\n' > "$GC_HOSTS"
mount --bind "$GC_HOSTS" /etc/hosts
exec "$GC_PY" -c "$GC_RANKS"
"""

RANKS = r"""
import json
from coordinator.testing import run_distributed
from tests.coordinator.group.test_gloo_interface import _world_rank
print(json.dumps(run_distributed(_world_rank, 2, timeout=60)), flush=True)
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("preset,listens_on", [
    pytest.param(None, "127.0.0.1", id="unset"),
    pytest.param("gcv0", "10.77.0.1", id="user-set", marks=pytest.mark.slow)])
def test_a_host_named_on_the_network_keeps_a_loopback_world_local(
        preset: str | None, listens_on: str, tmp_path) -> None:
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "ip", "mount")):
        pytest.skip("needs root, unshare, ip and mount (a private network namespace)")
    env = child_env()
    env.pop(gi.GLOO_IFNAME_ENV, None)
    if preset is not None:
        env[gi.GLOO_IFNAME_ENV] = preset
    env.update(GC_HOSTS=str(tmp_path / "hosts"), GC_PY=sys.executable, GC_RANKS=RANKS)
    proc = subprocess.run(["unshare", "--net", "--uts", "--mount", "--propagation", "private",
                           "sh", "-c", NAMESPACE], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)
    if proc.returncode and ("unshare failed" in proc.stderr or "RTNETLINK" in proc.stderr):
        pytest.skip(f"no private network namespace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for got in json.loads(proc.stdout.strip().splitlines()[-1]):
        gloo_pairs = [a for a in got["listening"] if a != "127.0.0.1"] or got["listening"]
        assert listens_on in got["listening"], got
        if preset is None:  # nothing listens on the network address
            assert got["listening"] == ["127.0.0.1"], got
            assert got["during"] is None and got["after"] is None, got
        else:
            assert got["during"] == got["after"] == preset, got
            assert gloo_pairs == [listens_on], got
