"""The removal primitives refuse everything that is not exactly ours; the reaper's
line protocol ignores what it does not understand. Real files, no mocks."""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any

import pytest

from shm_broadcast.lifecycle import leftovers
from shm_broadcast.lifecycle.reaper import Registry


def _socket(path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.close()


@pytest.fixture
def base(tmp_path: Any) -> str:
    return str(tmp_path)


def _channel_dir(base: str, *sockets: str) -> str:
    path = tempfile.mkdtemp(prefix="gc", dir=base)
    for name in sockets:
        _socket(os.path.join(path, name))
    with open(os.path.join(path, "owner"), "w") as f:
        f.write("{}")
    os.chmod(os.path.join(path, "owner"), 0o600)
    return path


def test_a_channel_directory_with_only_a_queues_files_is_removed(base: str) -> None:
    path = _channel_dir(base, "w", "p", "c", "r0", "r12")
    entries, reason = leftovers.inspect_channel_dir(path)
    assert reason is None and sorted(entries) == ["c", "owner", "p", "r0", "r12", "w"]
    assert leftovers.remove_channel_dir(path) is None
    assert not os.path.lexists(path)
    assert leftovers.remove_channel_dir(path) is None  # already gone: fine


@pytest.mark.parametrize("how,why", [
    ("name", "not a channel directory name"),
    ("mode", "mode 755, not 700"),
    ("file", "which a queue does not create"),
    ("socket-name", "which a queue does not create"),
    ("regular-w", "which a queue does not create"),
    ("link", "is a symbolic link"),
])
def test_anything_else_is_kept_with_the_reason(base: str, how: str, why: str) -> None:
    path = _channel_dir(base, "w")
    victim = os.path.join(base, "victim")
    open(victim, "w").close()
    if how == "name":
        os.rename(path, os.path.join(base, "gc-not-ours"))
        path = os.path.join(base, "gc-not-ours")
    elif how == "mode":
        os.chmod(path, 0o755)
    elif how == "file":
        open(os.path.join(path, "data"), "w").close()
    elif how == "socket-name":
        _socket(os.path.join(path, "x"))
    elif how == "regular-w":
        os.unlink(os.path.join(path, "w"))
        open(os.path.join(path, "w"), "w").close()
    elif how == "link":
        real = path
        path = os.path.join(base, "gclinklink")
        os.symlink(real, path)
    before = sorted(os.listdir(path))
    reason = leftovers.remove_channel_dir(path)
    assert reason is not None and why in reason, reason
    assert sorted(os.listdir(path)) == before and os.path.exists(victim)


def test_unlink_segment_refuses_names_that_are_not_segments() -> None:
    for name in ("../etc/passwd", "gc_mq_1_zz", "gc_mq_1_ab/../../x", "", "other"):
        assert leftovers.unlink_segment(name) is False


def test_reaper_lines_apply_in_order_and_garbage_is_ignored() -> None:
    reg = Registry()
    reg.feed(b"+s gc_mq_1_aa\n+d /tmp/gcabcdefgh\n-s gc_mq_1_aa\n+s gc_mq_1_b")
    assert reg.segments == set() and reg.dirs == {"/tmp/gcabcdefgh"}
    reg.feed(b"b\n")  # the rest of a line split across reads
    assert reg.segments == {"gc_mq_1_bb"}
    reg.feed(b"?? nonsense\n+x what\n+s\n\n" + b"z" * 10_000 + b"\n-d /tmp/gcabcdefgh\n")
    assert reg.segments == {"gc_mq_1_bb"} and reg.dirs == set()
