"""What to do next when a call could not reach the broker, for the Python client.

The CLI prints its own hints (``cli/errors.py``, in terms of its flags); a program that
uses :class:`dxpool.client.Client` gets these, in terms of the client's arguments and the
environment, on :attr:`dxpool.errors.DxpoolError.hint` and at the end of ``str(error)``.
"""

from __future__ import annotations

import grpc


def _looks_like_tls(message: str) -> bool:
    lowered = message.lower()
    return any(
        word in lowered
        for word in ("ssl", "handshake", "certificate", "tls", "verification", "peer name")
    )


def connection_hint(code: grpc.StatusCode, message: str, endpoint: str) -> str | None:
    """A next step for a call to ``endpoint`` that ended with ``code`` and ``message``
    because of the connection, or None when the broker itself answered."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (
            "give the client a certificate the broker's CA signed "
            "(Client(tls=ClientTls(ca=..., cert=..., key=...)), or DXPOOL_CERT and DXPOOL_KEY) "
            "or a bearer token (Client(token=...)), as the broker expects"
        )
    if code != grpc.StatusCode.UNAVAILABLE:
        return None
    if _looks_like_tls(message):
        return (
            "the TLS handshake failed: check the CA that signed the broker's certificate "
            "(ClientTls(ca=...) or DXPOOL_CA), your certificate and key, and that the broker "
            "serves TLS"
        )
    if "socket closed" in message.lower() or "connection reset" in message.lower():
        return (
            f"the broker at {endpoint} closed the connection: if it serves TLS (as `dxpool "
            "up` does), connect with Client(tls=ClientTls(...)), or set DXPOOL_CONFIG to the "
            "config file `dxpool up` wrote (.dxpool/config.yaml), which Client() reads"
        )
    if "failed to connect" in message.lower() or "connection refused" in message.lower():
        return (
            f"is the broker running at {endpoint}? start one with `dxpool up`, or give "
            "Client() the endpoint of a running broker (or DXPOOL_ENDPOINT)"
        )
    return None


__all__ = ["connection_hint"]
