"""Sealing the values a stateless group puts in its store: ChaCha20-Poly1305 under the secret.

The primitives are vetted implementations: ChaCha20-Poly1305 (RFC 8439) as the
AEAD and HKDF-SHA256 (RFC 5869) to derive keys, both from the ``cryptography``
package, and the standard library's HMAC-SHA256 for the session record. This
module only lays out bytes around them.

A sealed value (format version 1)::

    version (1 byte: 0x01) | nonce (12 bytes) | ciphertext (len(plaintext) bytes) | tag (16)

* **Key**: ``HKDF-SHA256(ikm=secret, salt=session, info=VALUE_KEY_INFO)``, 32
  bytes: one key per session of a group. ``session`` is what the ranks agreed
  on (:mod:`coordinator.stateless.session_agreement`: a hash of a fresh random
  nonce of :data:`SESSION_BYTES` from every rank).
* **Nonce**: 12 fresh random bytes per value. Values are control messages: a
  session seals far fewer than the 2**32 values per key up to which random
  96-bit nonces keep the chance of a repeat below 2**-32. Random nonces need no
  counter shared between the ranks that seal under the same key.
* **Associated data**: ``version | u32 len | name | u64 port | u64 world_size |
  u32 len | session | u32 len | key`` (little-endian lengths, UTF-8 strings),
  so a value is bound to its format version, its group (name, store port,
  size, session) and the store key it was put under.

A value is checked in this order, before any byte of it is decrypted: its
length (:data:`MIN_SEALED_BYTES` to ``MIN_SEALED_BYTES + MAX_OBJECT_BYTES``),
its version byte, then its tag. Every failure raises
:class:`~coordinator.errors.AuthenticationError` naming the likely cause.

A session record (each rank publishes one, see
:mod:`coordinator.stateless.session_agreement`) is ``payload |
HMAC-SHA256(k, message)`` (:func:`session_tag`) with ``k = HKDF-SHA256(ikm=secret,
info=SESSION_KEY_INFO)`` and the message binding the group's name, the
record's key (hence its rank), the store port, the world size and the payload:
a record copied into another group's store (the same secret and name, another
port or size) or under another rank's key fails.

Without a secret (``insecure=True``) values are only framed: ``GCS1 | 0x00 |
plaintext``, neither authenticated nor encrypted.
"""

from __future__ import annotations

import hmac
import secrets
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from coordinator.errors import AuthenticationError
from shm_broadcast.ranks.group_adapter import MAX_OBJECT_BYTES

__all__ = [
    "FORMAT_VERSION",
    "MIN_SEALED_BYTES",
    "NONCE_BYTES",
    "SESSION_BYTES",
    "SESSION_KEY_INFO",
    "TAG_BYTES",
    "VALUE_KEY_INFO",
    "Sealer",
    "session_tag",
]

#: First byte of every sealed value: the layout described in the module docstring.
FORMAT_VERSION = 1
#: Bytes of a value's random nonce (ChaCha20-Poly1305's 96-bit nonce).
NONCE_BYTES = 12
#: Bytes of a value's Poly1305 tag.
TAG_BYTES = 16
#: Bytes of the random nonce each rank contributes to its group's session.
SESSION_BYTES = 16
#: Length of a sealed empty value: the shortest a sealed value can be.
MIN_SEALED_BYTES = 1 + NONCE_BYTES + TAG_BYTES
#: HKDF ``info`` of the value key (format version 1).
VALUE_KEY_INFO = b"groupcoord stateless-group value key v1"
#: HKDF ``info`` of the session record's HMAC key (format version 1).
SESSION_KEY_INFO = b"groupcoord stateless-group session-record key v1"

_KEY_BYTES = 32
_MAX_SEALED = MIN_SEALED_BYTES + MAX_OBJECT_BYTES
_VERSION_BYTE = bytes([FORMAT_VERSION])
_PLAIN_FRAME = b"GCS1\x00"
_HEAD = 1 + NONCE_BYTES


class Sealer:
    """Seals values for one session of one group, or frames them in clear.

    Args:
        name: The group's name.
        secret: The group's secret; None frames values in clear (insecure).
        session: The session the ranks agreed on (the HKDF salt).
        port: The store's port (0: not a TCP store).
        world_size: The group's size.
    """

    def __init__(self, name: str, secret: bytes | None = None, session: bytes = b"", *,
                 port: int = 0, world_size: int = 0) -> None:
        self._aead: ChaCha20Poly1305 | None = None
        self._ad_head = b""
        if secret is not None:
            self._aead = ChaCha20Poly1305(_derive_key(secret, session, VALUE_KEY_INFO))
            self._ad_head = (_VERSION_BYTE + _prefixed(name.encode())
                             + struct.pack("<QQ", port, world_size) + _prefixed(session))

    def seal(self, key: str, plain: bytes) -> bytes:
        """The value to store under ``key`` for ``plain`` (sealed, or framed when insecure).

        Raises:
            ValueError: ``plain`` is longer than ``MAX_OBJECT_BYTES`` (sealed mode).
        """
        if self._aead is None:
            return _PLAIN_FRAME + plain
        if len(plain) > MAX_OBJECT_BYTES:
            raise ValueError(f"plain must hold at most {MAX_OBJECT_BYTES} bytes, got {len(plain)}")
        nonce = secrets.token_bytes(NONCE_BYTES)
        return _VERSION_BYTE + nonce + self._aead.encrypt(nonce, plain, self._ad(key))

    def open(self, key: str, data: bytes) -> bytes:
        """The plaintext of ``data`` read under ``key``.

        Raises:
            AuthenticationError: Wrong size, framing, version or tag (nothing decrypted
                or decoded); the message names the likely causes.
        """
        n = len(data)
        if self._aead is None:
            if n > MAX_OBJECT_BYTES + len(_PLAIN_FRAME) or data[:len(_PLAIN_FRAME)] != _PLAIN_FRAME:
                raise AuthenticationError(f"value of {n} bytes is not a plain groupcoord value")
            return data[len(_PLAIN_FRAME):]
        if not MIN_SEALED_BYTES <= n <= _MAX_SEALED:
            raise AuthenticationError(
                f"value of {n} bytes is not sealed with this group's secret (a sealed value "
                f"has {MIN_SEALED_BYTES} to {_MAX_SEALED} bytes): truncated, or written by a "
                f"process without the secret")
        if data[0] != FORMAT_VERSION:
            raise AuthenticationError(
                f"value has sealing format version {data[0]}, this rank reads version "
                f"{FORMAT_VERSION}: written by another groupcoord release, or not a sealed value")
        view = memoryview(data)
        try:
            return self._aead.decrypt(view[1:_HEAD], view[_HEAD:], self._ad(key))
        except InvalidTag:
            raise AuthenticationError(
                "value has a wrong authentication tag: forged or altered, moved from another "
                "key, or sealed for another group or session (another secret, name, size or "
                "store port, or an earlier incarnation of this group: a replay)") from None

    def _ad(self, key: str) -> bytes:
        """The associated data of a value stored under ``key``."""
        return self._ad_head + _prefixed(key.encode())


def session_tag(secret: bytes, name: str, key: str, session: bytes, port: int = 0,
                world_size: int = 0) -> bytes:
    """The HMAC-SHA256 that authenticates the session record payload ``session`` of
    group ``name`` (a rank's nonce, and for ranks > 0 rank 0's nonce it answers).

    The record is stored under ``key``, for a group of ``world_size`` ranks whose
    store listens on ``port`` (0: not a TCP store): a session record copied into
    another group's store (the same secret and name, another port or size) or
    under another key fails.
    """
    message = (_prefixed(name.encode()) + _prefixed(key.encode())
               + struct.pack("<QQ", port, world_size) + _prefixed(session))
    mac_key = _derive_key(secret, b"", SESSION_KEY_INFO)
    return hmac.digest(mac_key, message, "sha256")


def _derive_key(secret: bytes, salt: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 of ``secret``: a 32-byte key for ``info`` (an empty salt: none)."""
    return HKDF(algorithm=hashes.SHA256(), length=_KEY_BYTES, salt=salt or None,
                info=info).derive(secret)


def _prefixed(field: bytes) -> bytes:
    """``field`` preceded by its length (u32, little-endian), so fields cannot run together."""
    return struct.pack("<I", len(field)) + field
