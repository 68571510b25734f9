"""Mutual challenge-response over the cluster secret; the secret itself never travels.

    server -> HELLO   [version, server_nonce, role]
    client -> AUTH    [client_nonce, HMAC(secret, "jpfs-client" | server_nonce | client_nonce)]
    server -> AUTH_OK [HMAC(secret, "jpfs-server" | client_nonce | server_nonce)]

Fresh nonces on both sides make a recorded exchange useless; the two labels stop a reflected
response from passing as the other side's proof.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from ..errors import AuthError, ProtocolError
from . import frame as F

NONCE_BYTES = 16
HANDSHAKE_TIMEOUT = 10.0


def _mac(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, label + a + b, hashlib.sha256).digest()


def _nonce(value: object) -> bytes:
    if not isinstance(value, bytes) or len(value) != NONCE_BYTES:
        raise ProtocolError("handshake: malformed nonce")
    return value


async def server_handshake(fs: F.FrameSocket, secret: bytes, role: str) -> None:
    """Prove both sides hold ``secret``; raise AuthError/ProtocolError and send the reason."""
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    async with fs.send_lock:
        await fs.send_frame(F.HELLO, [F.VERSION, server_nonce, role])
    kind, body_len, payload_len = await fs.read_header()
    if kind != F.AUTH or body_len > 4096 or payload_len:
        raise ProtocolError("handshake: expected an AUTH frame")
    body = await fs.read_body(body_len)
    if not isinstance(body, list) or len(body) != 2 or not isinstance(body[1], bytes):
        raise ProtocolError("handshake: malformed AUTH frame")
    client_nonce = _nonce(body[0])
    if not hmac.compare_digest(body[1], _mac(secret, b"jpfs-client", server_nonce, client_nonce)):
        raise AuthError()
    async with fs.send_lock:
        await fs.send_frame(F.AUTH_OK, [_mac(secret, b"jpfs-server", client_nonce, server_nonce)])


async def client_handshake(fs: F.FrameSocket, secret: bytes) -> str:
    """The client side of the handshake; returns the server's role ("meta", "storage")."""
    kind, body_len, payload_len = await fs.read_header()
    if kind != F.HELLO or body_len > 4096 or payload_len:
        raise ProtocolError("handshake: the server did not say HELLO (not a JPFS server?)")
    body = await fs.read_body(body_len)
    if not isinstance(body, list) or len(body) != 3:
        raise ProtocolError("handshake: malformed HELLO frame")
    version, server_nonce, role = body
    if version != F.VERSION:
        raise ProtocolError(f"handshake: server speaks protocol {version}, we speak {F.VERSION} "
                            "(another JPFS release: run one release on both)")
    server_nonce = _nonce(server_nonce)
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    async with fs.send_lock:
        await fs.send_frame(
            F.AUTH, [client_nonce, _mac(secret, b"jpfs-client", server_nonce, client_nonce)]
        )
    kind, body = await _read_small(fs)
    if kind == F.ERROR:
        raise F.decode_error(body)
    if kind != F.AUTH_OK or not isinstance(body, list) or len(body) != 1:
        raise ProtocolError("handshake: expected AUTH_OK")
    expected = _mac(secret, b"jpfs-server", client_nonce, server_nonce)
    if not isinstance(body[0], bytes) or not hmac.compare_digest(body[0], expected):
        raise AuthError("authentication failed: the server does not hold the cluster secret")
    return str(role)


async def _read_small(fs: F.FrameSocket) -> tuple[int, object]:
    kind, body_len, payload_len = await fs.read_header()
    if body_len > 4096 or payload_len:
        raise ProtocolError("handshake: oversize frame")
    return kind, await fs.read_body(body_len)

