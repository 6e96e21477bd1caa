"""The sealed-value format of coordinator.stateless.store_sealing, checked byte by byte.

These tests call the sealing functions directly (the group-level attacks run over
real stores in test_stateless_security.py). Every failure must be an
AuthenticationError naming its cause, never an exception from ``cryptography``.
"""

from __future__ import annotations

import os
import struct

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from coordinator.errors import AuthenticationError
from coordinator.stateless.store_sealing import (
    FORMAT_VERSION,
    MIN_SEALED_BYTES,
    Sealer,
    session_tag,
)
from shm_broadcast.ranks.group_adapter import MAX_OBJECT_BYTES

SECRET = bytes(range(32))
SESSION = bytes(range(100, 116))
NAME, KEY, PORT, WORLD = "g", "g/p2p/0->1/7", 29500, 4


def _sealer(**changes: object) -> Sealer:
    args: dict = {"name": NAME, "secret": SECRET, "session": SESSION, "port": PORT,
                  "world_size": WORLD}
    args.update(changes)
    return Sealer(args.pop("name"), args.pop("secret"), args.pop("session"), **args)


def _prefixed(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def test_a_sealed_value_is_chacha20_poly1305_as_documented() -> None:
    """Open a value with cryptography's primitives and the layout of the module
    docstring alone (its constants written out here): the documented format is
    the real one."""
    sealed = _sealer().seal(KEY, b"payload")
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=SESSION,
               info=b"groupcoord stateless-group value key v1").derive(SECRET)
    ad = (b"\x01" + _prefixed(NAME.encode()) + struct.pack("<QQ", PORT, WORLD)
          + _prefixed(SESSION) + _prefixed(KEY.encode()))
    assert sealed[0] == FORMAT_VERSION == 1
    assert len(sealed) == 1 + 12 + len(b"payload") + 16
    assert ChaCha20Poly1305(key).decrypt(sealed[1:13], sealed[13:], ad) == b"payload"


@pytest.mark.parametrize("n", [0, 1, 8 << 20, MAX_OBJECT_BYTES],
                         ids=["empty", "1B", "8MiB", "max"])
def test_round_trip(n: int) -> None:
    plain = os.urandom(n)
    sealer = _sealer()
    sealed = sealer.seal(KEY, plain)
    assert len(sealed) == MIN_SEALED_BYTES + n
    assert sealer.open(KEY, sealed) == plain
    assert _sealer().open(KEY, sealed) == plain  # another rank's sealer of the same session


def test_every_value_gets_a_fresh_nonce() -> None:
    sealer = _sealer()
    values = [sealer.seal(KEY, b"same plaintext") for _ in range(64)]
    assert len({v[1:13] for v in values}) == 64
    assert all(sealer.open(KEY, v) == b"same plaintext" for v in values)
    assert not any(b"same plaintext" in v for v in values)


def test_sizes_are_checked_before_anything_is_decrypted() -> None:
    sealer = _sealer()
    with pytest.raises(ValueError, match=f"plain must hold at most {MAX_OBJECT_BYTES} bytes"):
        sealer.seal(KEY, bytes(MAX_OBJECT_BYTES + 1))
    too_long = b"\x01" + bytes(MIN_SEALED_BYTES + MAX_OBJECT_BYTES)
    with pytest.raises(AuthenticationError, match=f"value of {len(too_long)} bytes is not sealed"):
        sealer.open(KEY, too_long)


@pytest.mark.parametrize("plain", [b"", b"x" * 100], ids=["empty", "100B"])
def test_truncation_at_every_length_fails_cleanly(plain: bytes) -> None:
    sealer = _sealer()
    sealed = sealer.seal(KEY, plain)
    for n in range(MIN_SEALED_BYTES):
        with pytest.raises(AuthenticationError, match=f"value of {n} bytes is not sealed"):
            sealer.open(KEY, sealed[:n])
    for n in range(MIN_SEALED_BYTES, len(sealed)):
        with pytest.raises(AuthenticationError, match="wrong authentication tag"):
            sealer.open(KEY, sealed[:n])


def test_an_unknown_version_byte_is_rejected() -> None:
    sealer = _sealer()
    sealed = sealer.seal(KEY, b"payload")
    for version in range(256):
        if version == FORMAT_VERSION:
            continue
        with pytest.raises(AuthenticationError, match=f"format version {version},"):
            sealer.open(KEY, bytes([version]) + sealed[1:])


@pytest.mark.parametrize("plain", [b"", b"\x00" * 24], ids=["empty", "24B"])
def test_a_flipped_bit_anywhere_fails(plain: bytes) -> None:
    sealer = _sealer()
    sealed = sealer.seal(KEY, plain)
    for i in range(len(sealed) * 8):
        altered = bytearray(sealed)
        altered[i // 8] ^= 1 << (i % 8)
        with pytest.raises(AuthenticationError):
            sealer.open(KEY, bytes(altered))


@pytest.mark.parametrize("other_key", ["g/p2p/0->1/8", "g/p2p/0->2/7", "", "G/p2p/0->1/7"])
def test_a_value_moved_to_another_key_fails(other_key: str) -> None:
    sealer = _sealer()
    sealed = sealer.seal(KEY, b"payload")
    with pytest.raises(AuthenticationError, match="wrong authentication tag"):
        sealer.open(other_key, sealed)


@pytest.mark.parametrize("change", [
    {"session": bytes(16)},
    {"secret": bytes(32)},
    {"name": "h"},
    {"port": PORT + 1},
    {"world_size": WORLD + 1},
], ids=["session", "secret", "name", "port", "world_size"])
def test_a_value_sealed_for_another_session_or_group_fails(change: dict) -> None:
    sealed = _sealer(**change).seal(KEY, b"payload")
    with pytest.raises(AuthenticationError, match="wrong authentication tag"):
        _sealer().open(KEY, sealed)


def test_insecure_values_are_framed_and_neither_mode_accepts_the_other() -> None:
    plain_sealer = Sealer(NAME)
    framed = plain_sealer.seal(KEY, b"payload")
    assert framed == b"GCS1\x00payload"
    assert plain_sealer.open(KEY, framed) == b"payload"
    with pytest.raises(AuthenticationError, match="not a plain groupcoord value"):
        plain_sealer.open(KEY, _sealer().seal(KEY, b"payload"))
    with pytest.raises(AuthenticationError, match=r"format version 71,"):  # b"G"
        _sealer().open(KEY, framed + bytes(MIN_SEALED_BYTES))


def test_the_session_tag_binds_every_field() -> None:
    base = (SECRET, NAME, "g/session", SESSION, PORT, WORLD)
    tag = session_tag(*base)
    assert len(tag) == 32 and session_tag(*base) == tag
    others = [(bytes(32), NAME, "g/session", SESSION, PORT, WORLD),
              (SECRET, "h", "g/session", SESSION, PORT, WORLD),
              (SECRET, NAME, "h/session", SESSION, PORT, WORLD),
              (SECRET, NAME, "g/session", bytes(16), PORT, WORLD),
              (SECRET, NAME, "g/session", SESSION, PORT + 1, WORLD),
              (SECRET, NAME, "g/session", SESSION, PORT, WORLD + 1)]
    assert len({session_tag(*o) for o in others} | {tag}) == len(others) + 1
