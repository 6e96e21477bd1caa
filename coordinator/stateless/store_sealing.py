"""Sealing the values a stateless group puts in its store: encrypt-then-MAC under the group's secret.

A sealed value is ``GCS1 | 0x01 | nonce(16) | ciphertext | tag(32)``: the
plaintext XOR a SHAKE-256 key stream of ``enc_key | nonce``, and
``tag = HMAC-SHA256(mac_key, len|name | len|key | header | ciphertext)``, so a
value is bound to its group and to the key it was stored under (a value moved
to another key fails). Both keys are HMAC-SHA256 of the secret with a label
and the session nonce that rank 0 publishes, itself authenticated by
:func:`session_tag` (which binds it to the group's name, size and store port).
Without a secret (``insecure=True``) values are only framed: ``GCS1 | 0x00 |
plaintext``. Sizes are checked before anything is decoded, and anything that
fails raises :class:`~coordinator.errors.AuthenticationError`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

from coordinator.errors import AuthenticationError
from shm_broadcast.ranks.group_adapter import MAX_OBJECT_BYTES

__all__ = ["NONCE_BYTES", "Sealer", "session_tag"]

_MAGIC = b"GCS1"
_SEALED, _PLAIN = 1, 0
#: Bytes of a value's (and of the session's) random nonce.
NONCE_BYTES = 16
_NONCE = NONCE_BYTES
_TAG = 32


class Sealer:
    """Seals values (encrypt-then-MAC) for one group and session, or frames them in clear.

    Layout of a sealed value: ``GCS1 | 0x01 | nonce(16) | ciphertext | tag(32)``,
    ``tag = HMAC-SHA256(mac_key, len|name | len|key | header | ciphertext)``. The
    ciphertext is the plaintext XOR ``SHAKE-256(enc_key | nonce)``. Both keys
    are HMAC-SHA256(secret, label | session).
    """

    def __init__(self, name: str, secret: bytes | None = None, session: bytes = b"") -> None:
        self._name = name.encode()
        self._mac_key = self._enc_key = b""
        if secret is not None:
            self._mac_key = hmac.new(secret, b"groupcoord-stateless-mac\0" + session,
                                     hashlib.sha256).digest()
            self._enc_key = hmac.new(secret, b"groupcoord-stateless-enc\0" + session,
                                     hashlib.sha256).digest()

    def seal(self, key: str, plain: bytes) -> bytes:
        """The value to store under ``key`` for ``plain`` (sealed, or framed when insecure)."""
        if not self._mac_key:
            return _MAGIC + bytes([_PLAIN]) + plain
        nonce = secrets.token_bytes(_NONCE)
        head = _MAGIC + bytes([_SEALED]) + nonce
        body = _xor(plain, hashlib.shake_256(self._enc_key + nonce).digest(len(plain)))
        return head + body + self._tag(key, head, body)

    def open(self, key: str, data: bytes) -> bytes:
        """The plaintext of ``data`` read under ``key``.

        Raises:
            AuthenticationError: Wrong size, framing, mode or tag (nothing decoded).
        """
        n = len(data)
        mode = data[len(_MAGIC)] if n > len(_MAGIC) and data[: len(_MAGIC)] == _MAGIC else -1
        if not self._mac_key:
            if mode != _PLAIN or n > MAX_OBJECT_BYTES + 5:
                raise AuthenticationError(f"value of {n} bytes is not a plain groupcoord value")
            return data[len(_MAGIC) + 1:]
        head_len = len(_MAGIC) + 1 + _NONCE
        if mode != _SEALED or not head_len + _TAG <= n <= head_len + _TAG + MAX_OBJECT_BYTES:
            raise AuthenticationError(
                f"value of {n} bytes is not sealed with this group's secret (wrong framing)")
        head, body, tag = data[:head_len], data[head_len:n - _TAG], data[n - _TAG:]
        if not hmac.compare_digest(tag, self._tag(key, head, body)):
            raise AuthenticationError("value has a wrong HMAC (forged, altered or moved)")
        return _xor(body, hashlib.shake_256(self._enc_key + head[-_NONCE:]).digest(len(body)))

    def _tag(self, key: str, head: bytes, body: bytes) -> bytes:
        k = key.encode()
        mac = hmac.new(self._mac_key, struct.pack("<I", len(self._name)) + self._name,
                       hashlib.sha256)
        mac.update(struct.pack("<I", len(k)) + k)
        mac.update(head)
        mac.update(body)
        return mac.digest()


def _xor(a: bytes, b: bytes) -> bytes:
    n = len(a)
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(n, "little")


def session_tag(secret: bytes, name: str, key: str, session: bytes, port: int = 0,
                world_size: int = 0) -> bytes:
    """The HMAC that authenticates session nonce ``session`` of group ``name`` stored under
    ``key``, for a group of ``world_size`` ranks whose store listens on ``port`` (0: not a
    TCP store): a session record copied into another group's store (the same secret and
    name, another port or size) fails."""
    nb, kb = name.encode(), key.encode()
    msg = (b"groupcoord-stateless-session\0" + struct.pack("<II", len(nb), len(kb)) + nb + kb
           + struct.pack("<II", port, world_size))
    return hmac.new(secret, msg + session, hashlib.sha256).digest()
