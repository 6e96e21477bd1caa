"""Attacks on StatelessProcessGroup, replayed with real processes, stores and sockets.

An outsider is a separate process that can reach the store's port (loopback)
but holds no secret. It writes pickles that would create a file, forged and
moved values, and reads what the ranks store. Nothing it writes is decoded,
nothing it reads reveals the payload, and the ranks either carry on (a valid
value arrives) or raise AuthenticationError.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest

from coordinator.errors import AuthenticationError, CollectiveMismatch, GroupCoordError
from coordinator.stateless.stateless_group import SECRET_ENV, StatelessProcessGroup
from coordinator.testing import free_port, run_distributed
from tests.child_env import ROOT as REPO_ROOT

HOST = "127.0.0.1"

# The outsider: connects to the store as a plain client and runs its actions
# (triples of action, key, argument) in order; prints what it read, one per line.
_OUTSIDER = r"""
import datetime, sys
import torch.distributed as dist
host, port = sys.argv[1:3]
s = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=20),
                  wait_for_workers=False)
args = sys.argv[3:]
for action, key, arg in zip(args[0::3], args[1::3], args[2::3]):
    if action == "set":
        s.set(key, bytes.fromhex(arg))
    elif action == "copy":
        s.wait([key]); s.set(arg, s.get(key))
    elif action == "read":
        s.wait([key]); sys.stdout.write(s.get(key).hex() + "\n")
"""


def _outsiders(port: int, actions: list[tuple[str, str, str]]) -> str:
    """Run one outsider process (no secret in its environment) doing ``actions``
    in order; returns its stdout."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    argv = [x for a in actions for x in a]
    out = subprocess.run([sys.executable, "-c", _OUTSIDER, HOST, str(port), *argv],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _outsider(port: int, action: str, key: str, arg: str = "") -> str:
    """One outsider action; returns what it read (empty for writes)."""
    return _outsiders(port, [(action, key, arg)]).strip()


class _CreateFile:
    """Unpickling this calls ``open(path, "w")``: proof of code execution if it happens."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def _evil_pickle(path: str) -> str:
    return pickle.dumps(_CreateFile(path), protocol=2).hex()


# ---------------------------------------------------------------------- tests
def test_store_listens_only_on_the_given_address() -> None:
    port = free_port()
    g = StatelessProcessGroup.create(HOST, port, 0, 1, timeout=10, name="bind")
    try:
        listening = [c.laddr for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert listening and all(a.ip == HOST for a in listening), listening
    finally:
        g.close()


def test_port_in_use_is_a_store_connection_error_and_leaves_no_key_file() -> None:
    import socket

    from coordinator.errors import StoreConnectionError
    from coordinator.stateless.group_secret import _key_file_path

    with socket.create_server((HOST, 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(StoreConnectionError, match=f"cannot listen on {HOST}:{port}"):
            StatelessProcessGroup.create(HOST, port, 0, 1, timeout=5, name="busy")
    assert not os.path.exists(_key_file_path(HOST, port, "busy"))


def test_a_second_rank_0_on_a_live_groups_port_leaves_its_key_file() -> None:
    """The second rank 0 fails to bind before it writes anything: the live group's key
    file (which its other ranks read) is neither replaced nor removed."""
    from coordinator.errors import StoreConnectionError
    from coordinator.stateless.group_secret import _key_file_path

    port = free_port()
    live = StatelessProcessGroup.create(HOST, port, 0, 1, timeout=10, name="live")
    try:
        path = _key_file_path(HOST, port, "live")
        with open(path, "rb") as f:
            key = f.read()
        with pytest.raises(StoreConnectionError, match=f"cannot listen on {HOST}:{port}"):
            StatelessProcessGroup.create(HOST, port, 0, 1, timeout=5, name="live")
        with open(path, "rb") as f:
            assert f.read() == key
        assert live.broadcast_obj("still", 0) == "still"
    finally:
        live.close()


@pytest.mark.parametrize("host", ["127.0.0.1\x00", " 127.0.0.1", "127.0.0.1\n", "a b"],
                         ids=["nul", "leading-space", "newline", "inner-space"])
def test_a_host_with_whitespace_or_nul_is_refused(host: str) -> None:
    with pytest.raises(ValueError, match="host must be a non-empty str without whitespace"):
        StatelessProcessGroup.create(host, free_port(), 0, 1, timeout=5)


@pytest.mark.parametrize("host", ["127.1", "2130706433", "0x7f.1"])
def test_a_short_ipv4_form_listens_on_the_address_it_denotes(host: str) -> None:
    port = free_port()
    g = StatelessProcessGroup.create(host, port, 0, 1, timeout=10, name="short")
    try:
        listening = {c.laddr.ip for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert listening == {"127.0.0.1"}, listening
    finally:
        g.close()


@pytest.mark.parametrize("secret_from", ["key-file", pytest.param("env", marks=pytest.mark.slow)])
def test_outsider_pickle_under_the_keys_runs_nothing(dist_pool, tmp_path, secret_from: str) -> None:
    marker = str(tmp_path / "pwned")
    if secret_from == "env":  # fresh ranks: the secret must be in their environment
        env = {SECRET_ENV: os.urandom(32).hex()}
        res = run_distributed(_rank_pickle_attack, 2, free_port(), marker, env=env, timeout=120)
    else:
        res = dist_pool(2).run(_rank_pickle_attack, free_port(), marker, timeout=120)
    assert not os.path.exists(marker), "an outsider's pickle was executed"
    assert res[1]["p2p"] == {"legit": 1}  # the rank carried on once the real value came
    assert res[1]["bcast"] == ("legit", 2)
    assert res[1]["rejected"] >= 2  # the outsider's values were seen and dropped
    assert res[0]["gather"] == res[1]["gather"] == [0, 1]
    assert res[1]["unanswered"].startswith("AuthenticationError") and "none was decoded" in \
        res[1]["unanswered"], res[1]["unanswered"]


def test_forged_moved_and_read_values_are_useless_to_an_outsider(dist_pool) -> None:
    res = dist_pool(2).run(_rank_forgery, free_port(), timeout=120)
    r1 = res[1]
    assert r1["first"] == "TOPSECRET-1"
    for what in ("moved", "forged"):
        assert r1[what].startswith("AuthenticationError"), r1
        assert "wrong authentication tag" in r1[what], r1
    assert r1["raw_pickle"].startswith("AuthenticationError"), r1
    assert not res[0]["plaintext_visible"]  # the outsider read only ciphertext


def test_unsendable_object_raises_type_error_naming_type_and_opt_in(dist_pool) -> None:
    res = dist_pool(2).run(_rank_unsendable, free_port(), timeout=120)
    assert "_CreateFile" in res[0] and "allow_pickle=True" in res[0], res[0]
    assert res[1].startswith("CollectiveMismatch") and "rank 0" in res[1], res[1]


def test_opt_in_pickle_round_trips_between_opted_in_ranks(dist_pool) -> None:
    res = dist_pool(2).run(_rank_opt_in, free_port(), timeout=120)
    assert res[1] == "complex:(1+2j)"


def test_secret_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="non-loopback.*secret"):
        StatelessProcessGroup.create("10.255.255.1", free_port(), 0, 1, timeout=5)
    with pytest.raises(TypeError, match="secret must be bytes, got str"):
        StatelessProcessGroup.create(HOST, free_port(), 0, 1, secret="x" * 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="secret must hold >= 16 bytes, got 4"):
        StatelessProcessGroup.create(HOST, free_port(), 0, 1, secret=b"abcd")
    with pytest.raises(ValueError, match="contradict"):
        StatelessProcessGroup.create(HOST, free_port(), 0, 1, secret=os.urandom(16), insecure=True)
    with pytest.raises(TypeError, match="host must be a str, got bytes"):
        StatelessProcessGroup.create(b"127.0.0.1", free_port(), 0, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="insecure must be a bool, got int"):
        StatelessProcessGroup.create(HOST, free_port(), 0, 1, insecure=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="allow_pickle must be a bool"):
        StatelessProcessGroup.create(HOST, free_port(), 0, 1, allow_pickle=1)  # type: ignore[arg-type]


def test_bad_secret_environment_variable_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "not-hex")
    with pytest.raises(ValueError, match=SECRET_ENV):
        StatelessProcessGroup.create(HOST, free_port(), 0, 1, timeout=5)
    monkeypatch.setenv(SECRET_ENV, "ab" * 8)
    with pytest.raises(ValueError, match="32 hex digits"):
        StatelessProcessGroup.create(HOST, free_port(), 0, 1, timeout=5)


def test_direct_construction_needs_a_secret_unless_the_store_is_on_loopback(dist_pool) -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    with pytest.raises(ValueError, match="needs a shared secret"):
        StatelessProcessGroup(0, 1, store)
    with pytest.raises(TypeError, match="name must be a str"):
        StatelessProcessGroup(0, 1, store, name=3, insecure=True)  # type: ignore[arg-type]
    g = StatelessProcessGroup(0, 1, store, name="h", secret=os.urandom(16))
    assert g.broadcast_obj(("x", {1}), src=0) == ("x", {1})
    g.barrier()
    g.close()
    res = dist_pool(2).run(_rank_own_store, free_port(), timeout=120)
    assert res == [[(0, "own"), (1, "own")]] * 2


def test_mismatched_secrets_fail_authentication_promptly(dist_pool, tmp_path) -> None:
    res = dist_pool(2).run(_rank_wrong_secret, free_port(), str(tmp_path / "done"),
                           timeout=120)
    assert res[1].startswith("AuthenticationError") and "session" in res[1], res[1]


def test_insecure_mode_still_never_unpickles(dist_pool, tmp_path) -> None:
    marker = str(tmp_path / "pwned")
    res = dist_pool(2).run(_rank_insecure, free_port(), marker, timeout=120)
    assert not os.path.exists(marker)
    assert res[1]["framed_pickle"].startswith("CollectiveMismatch") and \
        "not unpickled" in res[1]["framed_pickle"], res[1]
    assert res[1]["after"] == ["still", "working"]


@pytest.mark.parametrize("n", [pytest.param(5_000, id="short"),
                               pytest.param(100_000, id="100k", marks=pytest.mark.slow)])
def test_every_altered_sealed_value_fails_authentication(n: int) -> None:
    import random

    from coordinator.stateless.store_sealing import Sealer as _Sealer
    from shm_broadcast.ranks.group_adapter import encode_object

    rng = random.Random(n)
    sealer = _Sealer("g", os.urandom(32), os.urandom(16))
    key = "g/p2p/0->1/0"
    sealed = sealer.seal(key, encode_object({"ids": [1, 2, 3], "t": ("a", b"b")}))
    assert sealer.open(key, sealed) == encode_object({"ids": [1, 2, 3], "t": ("a", b"b")})
    for _ in range(n):
        data = bytearray(sealed)
        for _ in range(rng.randint(1, 3)):
            op = rng.random()
            if op < 0.7 and data:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            elif op < 0.85 or not data:
                data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
            else:
                del data[rng.randrange(len(data)):]
        if bytes(data) == sealed:
            continue
        with pytest.raises(AuthenticationError):
            sealer.open(key, bytes(data))
    with pytest.raises(AuthenticationError, match="wrong authentication tag"):
        sealer.open("g/p2p/0->1/1", sealed)  # moved to another key


def test_authentication_error_is_in_the_family() -> None:
    e = AuthenticationError("x", rejected=3, queue="g", peers=[1])
    assert isinstance(e, GroupCoordError) and isinstance(e, PermissionError)
    back = pickle.loads(pickle.dumps(e))
    assert (back.rejected, back.queue, back.peers, str(back)) == (3, "g", (1,), "x")


# ---------------------------------------------------------------------- on the ranks
def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _rank_pickle_attack(rank: int, world_size: int, port: int, marker: str) -> dict:
    g = StatelessProcessGroup.create(HOST, port, rank, world_size, timeout=30, name="stateless")
    out: dict[str, Any] = {}
    if rank == 0:
        evil = _evil_pickle(marker)
        _outsiders(port, [("set", key, evil) for key in
                          ("stateless/p2p/0->1/0", "stateless/bcast/0/0", "stateless/p2p/0->1/1")])
        g.barrier()
        time.sleep(0.5)  # rank 1 is now reading the outsider's values
        g.send_obj({"legit": 1}, dst=1)
        g.broadcast_obj(("legit", 2), src=0)
    else:
        g.barrier()
        out["p2p"] = g.recv_obj(src=0, timeout=20)
        out["bcast"] = g.broadcast_obj(None, src=0, timeout=20)
        try:  # only the outsider's value is ever under p2p/0->1/1
            g.recv_obj(src=0, timeout=1.0)
        except AuthenticationError as e:
            out["unanswered"] = _err(e)
        out["rejected"] = g.rejected_values
    out["gather"] = g.all_gather_obj(rank)
    g.barrier()
    g.close()
    return out


def _rank_forgery(rank: int, world_size: int, port: int) -> dict:
    g = StatelessProcessGroup.create(HOST, port, rank, world_size, timeout=30, name="f")
    out: dict[str, Any] = {}
    if rank == 0:
        g.send_obj("TOPSECRET-1", dst=1)
        seen = bytes.fromhex(_outsider(port, "read", "f/p2p/0->1/0"))
        out["plaintext_visible"] = b"TOPSECRET" in seen
        forged = bytearray(seen)
        forged[-17] ^= 1  # one ciphertext bit flipped (the byte before the 16-byte tag)
        _outsiders(port, [
            ("copy", "f/p2p/0->1/0", "f/p2p/0->1/1"),  # a valid value, moved
            ("set", "f/p2p/0->1/2", bytes(forged).hex()),
            ("set", "f/p2p/0->1/3", pickle.dumps(["plain pickle"]).hex()),
        ])
        g.barrier()
    else:
        g.barrier()
        out["first"] = g.recv_obj(src=0)
        for what in ("moved", "forged", "raw_pickle"):
            try:
                out[what] = repr(g.recv_obj(src=0, timeout=1.0))
            except AuthenticationError as e:
                out[what] = _err(e)
    g.barrier()
    g.close()
    return out


def _rank_unsendable(rank: int, world_size: int, port: int) -> str:
    g = StatelessProcessGroup.create(HOST, port, rank, world_size, timeout=30, name="u")
    try:
        if rank == 0:
            try:
                g.send_obj(_CreateFile("/nonexistent/never"), dst=1)
            except TypeError as e:
                return str(e)
            return "no error"
        try:
            return repr(g.recv_obj(src=0, timeout=20))
        except CollectiveMismatch as e:
            return _err(e)
    finally:
        g.barrier()
        g.close()


def _rank_opt_in(rank: int, world_size: int, port: int) -> str:
    g = StatelessProcessGroup.create(HOST, port, rank, world_size, timeout=30, name="o",
                                     allow_pickle=True)
    got = g.broadcast_obj(1 + 2j if rank == 0 else None, src=0)
    g.barrier()
    g.close()
    return f"{type(got).__name__}:{got}"


def _rank_insecure(rank: int, world_size: int, port: int, marker: str) -> dict:
    g = StatelessProcessGroup.create(HOST, port, rank, world_size, timeout=30, name="i",
                                     insecure=True)
    out: dict[str, Any] = {}
    if rank == 0:  # a correctly framed plain value whose payload is a pickle
        _outsider(port, "set", "i/p2p/0->1/0", (b"GCS1\x00p" + bytes.fromhex(
            _evil_pickle(marker))).hex())
    g.barrier()
    if rank == 1:
        try:
            out["framed_pickle"] = repr(g.recv_obj(src=0, timeout=10))
        except CollectiveMismatch as e:
            out["framed_pickle"] = _err(e)
    out["after"] = g.broadcast_obj(["still", "working"] if rank == 0 else None, src=0)
    g.barrier()
    g.close()
    return out


def _rank_own_store(rank: int, world_size: int, port: int) -> list:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(HOST, port, world_size, rank == 0, datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    g = StatelessProcessGroup(rank, world_size, store, name="own", timeout=30)
    got = g.all_gather_obj((rank, "own"))
    g.barrier()
    g.close()
    return got


def _rank_wrong_secret(rank: int, world_size: int, port: int, done: str) -> str:
    secret = bytes([rank + 1]) * 32  # every rank a different secret
    try:
        g = StatelessProcessGroup.create(HOST, port, rank, world_size, timeout=3, name="w",
                                         secret=secret)
    except AuthenticationError as e:
        open(done, "w").close()
        return _err(e)
    deadline = time.monotonic() + 10
    while rank == 0 and not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.02)  # keep the store up until rank 1 has given up
    g.close()
    return "created"


def _rank_squatted(rank: int, world_size: int, port: int) -> tuple[str, Any]:
    from coordinator.stateless.group_secret import _key_dir

    g = StatelessProcessGroup.create(HOST, port, rank, world_size, timeout=30, name="squat")
    try:
        got = g.broadcast_obj("formed" if rank == 0 else None, 0)
        g.barrier()
    finally:
        g.close()
    return _key_dir(), got


# Run in a private mount namespace whose /dev/shm is a fresh tmpfs: user
# ``nobody`` takes the name of the key directory first, then a two-rank group
# forms on loopback without a secret.
_SQUATTED = r"""
import os, pwd, sys
from coordinator.stateless.group_secret import _key_dir
from coordinator.testing import run_distributed
from tests.coordinator.stateless.test_stateless_security import _rank_squatted
taken = f"/dev/shm/groupcoord-{os.geteuid()}"
nobody = pwd.getpwnam("nobody")
def squat(path):  # user nobody creates the directory ``path``
    pid = os.fork()
    if pid == 0:
        os.setgroups([]); os.setgid(nobody.pw_gid); os.setuid(nobody.pw_uid)
        os.mkdir(path, 0o700)
        os._exit(0)
    os.waitpid(pid, 0)
squat(taken)
assert os.lstat(taken).st_uid == nobody.pw_uid
print(run_distributed(_rank_squatted, 2, int(sys.argv[1]), timeout=60))
print("left", sorted(n for n in os.listdir(_key_dir()) if n.startswith("stateless-")))
# A uid without a passwd entry (a container's arbitrary uid), its name taken too.
homeless = 54321
squat(f"/dev/shm/groupcoord-{homeless}")
pid = os.fork()
if pid == 0:
    os.setgroups([]); os.setgid(homeless); os.setuid(homeless)
    from coordinator.errors import AuthenticationError
    from coordinator.stateless.stateless_group import StatelessProcessGroup
    try:
        StatelessProcessGroup.create("127.0.0.1", int(sys.argv[1]) + 1, 0, 1, timeout=10)
        os._exit(1)
    except AuthenticationError as e:
        os._exit(0 if "no home directory" in str(e) else 2)
    except BaseException:
        os._exit(3)
_, status = os.waitpid(pid, 0)
print("homeless", os.waitstatus_to_exitcode(status))
# The name is taken only after rank 1 looked for the key (first use after boot):
# rank 0 then writes in the home directory, and rank 1 must still find the key.
from coordinator.stateless.group_secret import secret_plan, remove_quietly
os.rmdir(taken)
read, _ = secret_plan(1, "127.0.0.1", int(sys.argv[1]) + 2, "late", None, False)
squat(taken)
source, key_file = secret_plan(0, "127.0.0.1", int(sys.argv[1]) + 2, "late", None, False)
print("late", read() == source(), key_file.startswith(taken))
remove_quietly(key_file)
# The name is taken while rank 0 writes (the key goes to the home directory) and
# let go before rank 1 reads: rank 1 must still find the key.
source, key_file = secret_plan(0, "127.0.0.1", int(sys.argv[1]) + 3, "released", None, False)
os.rmdir(taken)
read, _ = secret_plan(1, "127.0.0.1", int(sys.argv[1]) + 3, "released", None, False)
print("released", read() == source(), key_file.startswith(taken))
remove_quietly(key_file)
"""


def test_another_user_taking_the_key_directory_name_does_not_stop_the_group() -> None:
    import pwd
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root (to become nobody, and for a private /dev/shm) and unshare")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")
    script = ("mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec \"$0\" -c \"$1\" \"$2\"")
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
         sys.executable, _SQUATTED, str(free_port())],
        capture_output=True, text=True, timeout=90,
        cwd=REPO_ROOT)
    if proc.returncode and "unshare failed" in proc.stderr:
        pytest.skip(f"no private mount namespace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    home = pwd.getpwuid(os.geteuid()).pw_dir
    where = f"{home}/.cache/groupcoord-keys"
    assert f"[('{where}', 'formed'), ('{where}', 'formed')]" in proc.stdout, proc.stdout
    assert "left []" in proc.stdout, proc.stdout  # the key file was removed after setup
    assert "homeless 0" in proc.stdout, proc.stdout  # AuthenticationError saying why
    assert "late True False" in proc.stdout, proc.stdout  # found where rank 0 wrote it
    assert "released True False" in proc.stdout, proc.stdout  # found after the name is let go


def _store_client(port: int) -> Any:
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("other", ["port", "world_size"])
def test_a_session_record_relayed_from_another_group_fails(other: str) -> None:
    """Two groups of one job share the secret and the default name; an outsider (no
    secret, but reach to both stores) copies group A's session record into group B's
    store: B's ranks must not adopt A's session (whose values the outsider could then
    relay to them). ``port``: A runs beside B on another port; ``world_size``: A ran
    earlier on B's port with another size, and the outsider replays its record."""
    secret = StatelessProcessGroup.generate_secret()
    pa = free_port()
    pb = pa if other == "world_size" else free_port()
    a = StatelessProcessGroup.create(HOST, pa, 0, 3 if other == "world_size" else 2,
                                     timeout=5, secret=secret)
    record = _store_client(pa).get("stateless/session")
    if other == "world_size":
        a.close()
    b = StatelessProcessGroup.create(HOST, pb, 0, 2, timeout=5, secret=secret)
    try:
        _store_client(pb).set("stateless/session", record)
        with pytest.raises(AuthenticationError, match="failed authentication"):
            StatelessProcessGroup.create(HOST, pb, 1, 2, timeout=1.5, secret=secret)
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("source", ["another-group", "an-earlier-run"])
def test_a_value_relayed_from_another_session_fails(source: str) -> None:
    """An outsider (no secret, reach to both stores) copies a sealed value of group A
    into group B's store under the very key B's rank 1 reads next. A and B share the
    secret, the name and the size; ``another-group``: A runs beside B on another
    port; ``an-earlier-run``: A ran earlier on B's port. Only the session differs,
    and the value fails authentication."""
    secret = StatelessProcessGroup.generate_secret()
    pa = free_port()
    pb = pa if source == "an-earlier-run" else free_port()
    a0 = StatelessProcessGroup.create(HOST, pa, 0, 2, timeout=10, secret=secret)
    a1 = StatelessProcessGroup.create(HOST, pa, 1, 2, timeout=10, secret=secret)
    a0.send_obj("from A", dst=1)
    relayed = _store_client(pa).get("stateless/p2p/0->1/0")
    assert a1.recv_obj(src=0) == "from A"  # the value is authentic in its own group
    if source == "an-earlier-run":
        a1.close()
        a0.close()
    b0 = StatelessProcessGroup.create(HOST, pb, 0, 2, timeout=10, secret=secret)
    b1 = StatelessProcessGroup.create(HOST, pb, 1, 2, timeout=10, secret=secret)
    try:
        # Rank 0 sends (it agrees on the session, which rank 1's first call waits
        # for); the outsider writes the relayed value over it before rank 1 reads.
        b0.send_obj("from B", dst=1)
        _store_client(pb).set("stateless/p2p/0->1/0", relayed)
        with pytest.raises(AuthenticationError, match="wrong authentication tag"):
            b1.recv_obj(src=0, timeout=1.0)
        assert b1.rejected_values >= 1
    finally:
        for g in (b1, b0, a1, a0):
            g.close()
