"""Where a stateless group's secret comes from: the argument, the environment, or a key file.

In order: the ``secret`` argument (>= 16 bytes); the hex environment variable
:data:`SECRET_ENV` that a launcher sets for every rank; for a store on a
loopback address only, a random secret that rank 0 writes to a file only its
user can read (``/dev/shm/groupcoord-<uid>/stateless-<port>-<tag>.key``,
directory 0700, file 0600, written atomically) and the other ranks read. Where
another user took that directory's name first (``/dev/shm`` is writable by
all), the ranks use ``~/.cache/groupcoord-keys`` in the user's home (from the
password database, so every rank of the user agrees), which no one else can
create: a squatter cannot stop the group from forming. A
file is trusted only if it is a regular file of ours, mode 0600 in a 0700
directory of ours, of exactly 32 bytes; key files older than a day (left by
ranks that died during setup) are pruned when a new one is written. A
non-loopback store without a secret is refused unless ``insecure=True``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
import tempfile
import time
from collections.abc import Callable
from typing import Any

from coordinator.errors import AuthenticationError
from shm_broadcast.ranks.host_address import is_loopback_host

__all__ = ["SECRET_ENV", "MIN_SECRET", "secret_plan", "remove_quietly"]

#: Environment variable holding the group secret as hex (at least 32 hex digits).
SECRET_ENV = "GROUPCOORD_GROUP_SECRET"
#: Fewest bytes of a secret.
MIN_SECRET = 16
_MIN_SECRET = MIN_SECRET


_AUTO = b"<auto>"


def _resolve_secret(secret: Any, insecure: bool, auto_ok: bool = False) -> bytes | None:
    """The group secret from the argument or :data:`SECRET_ENV`; None if insecure.

    Returns :data:`_AUTO` when neither is set and ``auto_ok`` (loopback key file).
    """
    if secret is not None:
        if not isinstance(secret, (bytes, bytearray)):
            raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
        if len(secret) < _MIN_SECRET:
            raise ValueError(f"secret must hold >= {_MIN_SECRET} bytes, got {len(secret)}")
        if insecure:
            raise ValueError("secret and insecure=True contradict each other; pass one")
        return bytes(secret)
    env = os.environ.get(SECRET_ENV, "")
    if env and not insecure:
        try:
            value = bytes.fromhex(env.strip())
        except ValueError:
            raise ValueError(f"{SECRET_ENV} must be hex digits, got {len(env)} characters "
                             "that are not all hex (value not shown)") from None
        if len(value) < _MIN_SECRET:
            raise ValueError(
                f"{SECRET_ENV} must hold >= {2 * _MIN_SECRET} hex digits, got {len(env)}")
        return value
    if insecure:
        return None
    if auto_ok:
        return _AUTO
    raise ValueError(
        f"a StatelessProcessGroup needs a shared secret: pass secret=<bytes> or set {SECRET_ENV} "
        f"(hex) on every rank, or pass insecure=True")


def uses_key_file(host: str, secret: Any, insecure: bool) -> bool:
    """Whether a group on ``host`` with these arguments takes its secret from a local
    key file (so all its ranks are on this host); checks what :func:`secret_plan`
    checks, before anything is made.

    Raises:
        TypeError, ValueError: ``secret`` (or the environment's) is malformed, or
            there is none and ``host`` is not a loopback address.
    """
    if _resolve_secret(secret, insecure, auto_ok=True) is not _AUTO:
        return False
    if not is_loopback_host(host):
        raise _no_secret_error(host)
    return True


def _no_secret_error(host: str) -> ValueError:
    return ValueError(
        f"a stateless group on non-loopback host {host!r} needs a shared secret: pass "
        f"secret=<the same >= {_MIN_SECRET} random bytes on every rank>, or set "
        f"{SECRET_ENV}=<hex> in every rank's environment (e.g. from secrets.token_hex(32) "
        f"in the launcher), or pass insecure=True")


def secret_plan(rank: int, host: str | None, port: int, name: str, secret: Any,
                 insecure: bool) -> tuple[Callable[[], bytes | None] | None, str | None]:
    """``(secret source or None if insecure, key file this rank writes or None)``.

    Raises:
        ValueError: No secret, and the store is not on a loopback address.
    """
    fixed = _resolve_secret(secret, insecure, auto_ok=host is not None)
    if fixed is None:
        return None, None
    if fixed is not _AUTO:
        return (lambda: fixed), None
    host = str(host)  # set: _AUTO comes only with a host
    if not is_loopback_host(host):
        raise _no_secret_error(host)
    if rank == 0:
        path = _key_file_path(host, port, name)
        return _write_key_file(path), path
    # Rank 0 wrote to whichever directory was ours when it looked; another user
    # may have taken the /dev/shm name, or let it go, since. So every read tries
    # the directory that would be chosen now, then the other one: each is read
    # only if private and ours.
    return (lambda: _read_first(_key_file_paths(host, port, name))), None


def _shared_key_dir() -> str:
    """``/dev/shm/groupcoord-<uid>`` (the temporary directory without /dev/shm)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"groupcoord-{os.geteuid()}")


def _home_key_dir() -> str | None:
    """``~/.cache/groupcoord-keys``; None without a home directory."""
    import pwd

    try:
        home = pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        return None
    return os.path.join(home, ".cache", "groupcoord-keys") if home and os.path.isdir(home) else None


def _key_dir() -> str:
    """``/dev/shm/groupcoord-<uid>``, unless another user holds that name: then a
    directory in this user's home (see the module docstring)."""
    uid = os.geteuid()
    shared = _shared_key_dir()
    try:
        st = os.lstat(shared)
    except FileNotFoundError:
        return shared
    if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
        return shared
    home = _home_key_dir()
    if home is None:
        raise AuthenticationError(
            f"another user (uid {st.st_uid}) holds {shared!r}, and uid {uid} has no home "
            f"directory to keep the group's key file in instead; pass secret=<bytes> or set "
            f"{SECRET_ENV}=<hex> on every rank")
    return home


def _key_file_name(host: str, port: int, name: str) -> str:
    tag = hashlib.sha256(f"{host}\0{port}\0{name}".encode()).hexdigest()[:16]
    return f"stateless-{port}-{tag}.key"


def _key_file_path(host: str, port: int, name: str) -> str:
    return os.path.join(_key_dir(), _key_file_name(host, port, name))


def _key_file_paths(host: str, port: int, name: str) -> list[str]:
    """Where rank 0 may have written the key file: the directory chosen now first."""
    try:
        first = [_key_dir()]
    except AuthenticationError:  # the /dev/shm name taken and no home: only /dev/shm's
        first = []
    dirs = first + [d for d in (_shared_key_dir(), _home_key_dir()) if d and d not in first]
    return [os.path.join(d, _key_file_name(host, port, name)) for d in dirs]


def _read_first(paths: list[str]) -> bytes | None:
    """The secret in the first of ``paths`` that holds a private key file of ours."""
    for path in paths:
        secret = _read_key_file(path)
        if secret is not None:
            return secret
    return None


def _private_dir(path: str) -> None:
    """Make sure ``path`` is a directory of ours that nobody else can enter."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise AuthenticationError(
            f"refusing key directory {path!r}: it must be a directory owned by uid "
            f"{os.geteuid()} with mode 0700 (found uid {st.st_uid}, mode {oct(st.st_mode)})")


def _write_key_file(path: str) -> Callable[[], bytes]:
    """Write a fresh secret to ``path`` (0600, atomically); returns its source."""
    _private_dir(os.path.dirname(path))
    _prune_key_files(os.path.dirname(path))
    secret = secrets.token_bytes(32)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secret)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return lambda: secret


def _prune_key_files(directory: str, max_age_s: float = 86400.0) -> None:
    """Remove key files left by ranks that died during setup (older than a day)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    now = time.time()
    for n in names:
        path = os.path.join(directory, n)
        try:
            if n.startswith("stateless-") and now - os.lstat(path).st_mtime > max_age_s:
                os.unlink(path)
        except OSError:
            pass


def _read_key_file(path: str) -> bytes | None:
    """The secret in ``path`` if it is a private regular file of ours, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        d = os.lstat(os.path.dirname(path))
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077
                or d.st_uid != os.geteuid() or d.st_mode & 0o077 or st.st_size != 32):
            return None
        return os.read(fd, 32)
    finally:
        os.close(fd)


def remove_quietly(path: str) -> None:
    """Remove the file ``path`` if it is there."""
    with contextlib.suppress(OSError):
        os.unlink(path)
