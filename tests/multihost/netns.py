"""Two simulated hosts on one kernel: network, mount, UTS, IPC and pid namespaces.

:class:`TwoHosts` builds, for hosts ``a`` and ``b``::

    +--------------- host a ----------------+        +--------------- host b ----------------+
    | netns gcmh-<pid>-<n>a                 |        | netns gcmh-<pid>-<n>b                 |
    |   lo 127.0.0.1                        |  veth  |   lo 127.0.0.1                        |
    |   eth0 10.213.0.1/30  <---------------+--------+-->  eth0 10.213.0.2/30              |
    | per launch: mount ns (own /dev/shm    |        | per launch: mount ns (own /dev/shm    |
    |   tmpfs, /tmp, /etc/hosts, /sys),     |        |   tmpfs, /tmp, /etc/hosts, /sys),     |
    |   UTS ns (hostname), IPC ns, pid ns   |        |   UTS ns (hostname), IPC ns, pid ns   |
    +---------------------------------------+        +---------------------------------------+

No default route and no link to the machine's own network: traffic can only
go between the two hosts' veth ends (and each host's loopback). The two veth
ends are created directly inside the namespaces, so no interface ever exists
in the machine's own namespace.

:meth:`TwoHosts.launch` runs a command as a host: ``nsenter`` into its netns,
then ``unshare`` a mount, UTS, IPC and pid namespace, in which a small shell
script mounts a fresh ``tmpfs`` on ``/dev/shm``, binds the host's private
directory (``<workdir>/<host>/tmp``, readable by the driver) on ``/tmp`` (with
the machine's ``/tmp`` directories that hold the interpreter or the checkout
bound back in at their paths) and a
per-host ``hosts`` file on ``/etc/hosts`` (the hostname resolves to the
host's veth address, as on a configured machine), sets the hostname, and runs
the command under ``timeout``. After the command it writes its exit status
and the names left in ``/dev/shm`` to ``/tmp/rc`` and ``/tmp/shm-left``.

Clean-up holds on every exit path: the command's first process is pid 1 of
its pid namespace, and ``unshare --kill-child`` kills it when ``unshare``
dies, which takes every process of the namespace with it; ``unshare`` itself
dies with the driver (``PR_SET_PDEATHSIG``). Those two signals race with a
driver that dies while ``unshare`` is still forking, so the namespace also
watches a *lifeline*: a pipe whose only write end the driver holds; at its
end of file the script kills every process of the namespace. The mounts live only in the
launch's mount namespace, which ends with its last process. :meth:`close`
kills what is still running and deletes both network namespaces (which
removes the veth pair); :func:`sweep_stale` deletes namespaces left by a
driver that was SIGKILLed (their name carries its pid).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

__all__ = ["HOST_NAMES", "Host", "LaunchedHost", "TwoHosts", "unavailable_reason", "sweep_stale",
           "work_dir"]

PREFIX = "gcmh-"
NETNS_DIR = Path("/run/netns")
HOST_NAMES = ("a", "b")
_SUBNET = "10.213.0."
_TOOLS = ("ip", "nsenter", "unshare", "mount", "timeout", "hostname")
_counter = itertools.count()

#: Runs as pid 1 of the launch's namespaces. Arguments: hostname, hosts file,
#: the host's private /tmp, /dev/shm size, time limit (s), then the command.
#: Its fd 3 is the lifeline: the driver holds the only write end, so end of
#: file means the driver is gone, and every process of the namespace is
#: killed. Pid 1 (this script) ignores SIGKILL from inside its namespace, so
#: the watcher first sends it SIGTERM, which its trap turns into an exit as
#: soon as the command it runs was killed: it never goes on to start the next
#: one (the driver may die while the host is still being set up).
_HOST_SCRIPT = r"""
set -eu
name=$1 hosts=$2 tmpdir=$3 shm_size=$4 limit=$5 keep=$6
shift 6
trap 'exit 137' TERM
( read -r _ <&3 || true; kill -TERM 1; kill -KILL -1 2>/dev/null ) &
exec 3<&-
mount --bind "$hosts" /etc/hosts
mount -t tmpfs -o "size=$shm_size,mode=1777" gcmh-shm /dev/shm
# Directories of the machine's /tmp the command needs (a venv, a checkout)
# stay visible at the same path inside the host's private /tmp.
old_ifs=$IFS; IFS=:
for top in $keep; do
    mkdir -p "$tmpdir/$top"
    mount --bind "/tmp/$top" "$tmpdir/$top"
done
IFS=$old_ifs
mount --rbind "$tmpdir" /tmp
mount -t sysfs gcmh-sys /sys 2>/dev/null || true
hostname "$name"
unset XDG_RUNTIME_DIR TMPDIR
mkdir -p /tmp/out
set +e
timeout -k 3 -s TERM "$limit" "$@"
echo $? > /tmp/rc
ls -A /dev/shm > /tmp/shm-left
exit 0
"""


def kept_tmp_dirs() -> tuple[str, ...]:
    """The top-level directories of ``/tmp`` that hold this interpreter, its
    packages or the working directory (a CI venv or clone made with ``mktemp``):
    a host must still see them once its private ``/tmp`` covers the machine's."""
    import sys
    paths = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.executable, os.getcwd(),
             *sys.path]
    tops: set[str] = set()
    for p in filter(None, paths):
        parts = Path(os.path.realpath(p)).parts
        if len(parts) > 2 and parts[:2] == ("/", "tmp"):
            tops.add(parts[2])
    return tuple(sorted(t for t in tops if ":" not in t and os.path.isdir(f"/tmp/{t}")))


def unavailable_reason() -> str | None:
    """Why two hosts cannot be simulated here, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network, mount and pid namespaces)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (iproute2, util-linux, coreutils)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as e:
        return f"`ip netns add` does not work here: {e}"
    with contextlib.suppress(RuntimeError):
        _ip("netns", "del", probe)
    out = subprocess.run(["unshare", "--mount", "--uts", "--ipc", "--pid", "--fork",
                          "--mount-proc", "true"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return f"`unshare --mount --uts --ipc --pid` does not work here: {out.stderr.strip()}"
    return None


def _ip(*args: str) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def sweep_stale() -> list[str]:
    """Delete namespaces and work directories of this harness whose creator is gone.

    Only ``gcmh-<pid>-*`` names with a dead ``pid`` qualify: network
    namespaces in ``/run/netns`` and directories in the temp directory (a
    driver killed with SIGKILL leaves both; its processes die with it).

    Returns:
        The namespace names deleted.
    """
    gone = []
    names = sorted(p.name for p in NETNS_DIR.glob(PREFIX + "*")) if NETNS_DIR.is_dir() else []
    for name in filter(_owner_gone, names):
        try:
            _ip("netns", "del", name)
            gone.append(name)
        except RuntimeError:
            pass
    for d in Path(tempfile.gettempdir()).glob(PREFIX + "*"):
        if d.is_dir() and not d.is_symlink() and _owner_gone(d.name):
            shutil.rmtree(d, ignore_errors=True)
    return gone


def work_dir() -> Path:
    """A fresh work directory named after this process (swept once it is gone)."""
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))


def _owner_gone(name: str) -> bool:
    owner = name[len(PREFIX):].split("-", 1)[0]
    return owner.isdigit() and not _pid_alive(int(owner))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_driver() -> None:
    """In the child before exec: SIGKILL when the driver dies (survives exec)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class Host:
    """One simulated host.

    Attributes:
        key: ``"a"`` or ``"b"``.
        netns: Its network namespace's name.
        ip: The address of its ``eth0`` (the veth end).
        hostname: The name it reports (``gethostname``) and resolves.
        dir: ``<workdir>/<key>``: its ``tmp/`` is the host's ``/tmp``.
    """

    key: str
    netns: str
    ip: str
    hostname: str
    dir: Path

    @property
    def tmp(self) -> Path:
        """The host's ``/tmp`` as the driver sees it."""
        return self.dir / "tmp"

    @property
    def out(self) -> Path:
        """The host's ``/tmp/out`` as the driver sees it."""
        return self.tmp / "out"


@dataclass
class LaunchedHost:
    """A command running as a host (its ``unshare`` process and log)."""

    host: Host
    proc: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]
    lifeline: int
    started: float = field(default_factory=time.monotonic)

    def wait(self, deadline: float) -> int | None:
        """Wait until the launch ends or ``deadline`` (monotonic); its status or None."""
        try:
            return self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """End the launch: close the lifeline (every process in the namespace is
        killed) and SIGKILL ``unshare`` (its child, pid 1, dies with it)."""
        if self.lifeline >= 0:
            os.close(self.lifeline)
            self.lifeline = -1
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.log.close()

    def command_status(self) -> int | None:
        """Exit status of the command inside (124: timed out), None if unknown."""
        try:
            return int((self.host.tmp / "rc").read_text().strip())
        except (OSError, ValueError):
            return None

    def shm_left(self) -> list[str] | None:
        """Names left in the host's ``/dev/shm`` after the command, None if unknown."""
        try:
            return (self.host.tmp / "shm-left").read_text().split()
        except OSError:
            return None

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the launch's output (stdout and stderr)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class TwoHosts:
    """Two network namespaces joined by a veth pair; see the module docstring.

    Args:
        workdir: Directory for the hosts' ``/tmp`` and logs (created).
        hostnames: The two hostnames (equal names are allowed: hosts may
            share a name, the library must not care).
        shm_size: Size of each host's ``/dev/shm`` tmpfs (``mount`` syntax).
    """

    def __init__(self, workdir: Path, hostnames: Sequence[str] = ("gchost-a", "gchost-b"),
                 shm_size: str = "256m") -> None:
        self.workdir = Path(workdir)
        self.shm_size = shm_size
        tag = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.hosts: dict[str, Host] = {}
        for i, key in enumerate(HOST_NAMES):
            d = self.workdir / key
            self.hosts[key] = Host(key, f"{tag}{key}", f"{_SUBNET}{i + 1}", hostnames[i], d)
        self.launched: list[LaunchedHost] = []
        self._made: list[str] = []
        #: Top-level names in the machine's /tmp that every host still sees.
        self.kept_tmp = kept_tmp_dirs()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        a, b = self.hosts["a"], self.hosts["b"]
        for h in (a, b):
            _ip("netns", "add", h.netns)
            self._made.append(h.netns)
            h.tmp.mkdir(parents=True, exist_ok=True)
            os.chmod(h.tmp, 0o1777)
            # The hostname resolves to the host's own veth address (what gloo binds to).
            (h.dir / "hosts").write_text(
                f"127.0.0.1 localhost\n{h.ip} {h.hostname}\n"
                + "".join(f"{o.ip} {o.hostname}\n" for o in (a, b)
                          if o is not h and o.hostname != h.hostname))
        _ip("link", "add", "eth0", "netns", a.netns, "type", "veth",
            "peer", "name", "eth0", "netns", b.netns)
        for h in (a, b):
            _ip("-n", h.netns, "addr", "add", f"{h.ip}/30", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            _ip("-n", h.netns, "link", "set", "eth0", "up")

    def launch(self, key: str, argv: Sequence[str], env: Mapping[str, str],
               limit_s: float, cwd: str | None = None) -> LaunchedHost:
        """Run ``argv`` as host ``key`` for at most ``limit_s`` seconds (then SIGTERM, SIGKILL).

        Returns:
            The running launch; its output goes to ``<workdir>/<key>.log``.
        """
        h = self.hosts[key]
        log_path = self.workdir / f"{key}.log"
        read_end, lifeline = os.pipe()  # both close-on-exec; the child gets read_end as fd 3
        log = open(log_path, "ab")  # noqa: SIM115 (the launch owns it and closes it)

        cmd = ["nsenter", f"--net={NETNS_DIR / h.netns}", "--",
               "unshare", "--mount", "--uts", "--ipc", "--pid", "--fork", "--mount-proc",
               "--kill-child=SIGKILL", "--propagation", "private", "--",
               "/bin/sh", "-c", _HOST_SCRIPT, "gcmh-host", h.hostname, str(h.dir / "hosts"),
               str(h.tmp), self.shm_size, str(int(limit_s)), ":".join(self.kept_tmp),
               *argv]

        driver = os.getpid()

        def in_child() -> None:  # before exec: die with the driver; lifeline on fd 3
            _die_with_driver()
            if os.getppid() != driver:  # it died before the line above took effect
                os._exit(1)
            os.dup2(read_end, 3)

        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=dict(env), cwd=cwd,
                                    pass_fds=(3,), preexec_fn=in_child)
        except BaseException:
            log.close()
            os.close(lifeline)
            raise
        finally:
            os.close(read_end)
        launched = LaunchedHost(h, proc, log_path, log, lifeline)
        self.launched.append(launched)
        return launched

    def set_link(self, key: str, up: bool) -> float:
        """``ip link set eth0 up|down`` in host ``key``; returns the time (``time.time()``)."""
        t = time.time()
        _ip("-n", self.hosts[key].netns, "link", "set", "eth0", "up" if up else "down")
        return t

    def close(self) -> None:
        """Kill every launch still running and delete both namespaces (idempotent)."""
        for launched in self.launched:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                launched.kill()
        self.launched.clear()
        while self._made:
            name = self._made.pop()
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", name)
