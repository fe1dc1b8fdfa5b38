"""How API errors reach the operator: ``error: CODE: message`` and, where useful, a hint.

The hint says what to do next (start a broker, look at the plan, retry), the way a
colleague would; it never repeats the message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import click
import grpc

from dxpool.errors import DxpoolError, NotFound

EXIT_OK = 0
EXIT_API_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _looks_like_tls(message: str) -> bool:
    lowered = message.lower()
    return any(word in lowered for word in ("ssl", "handshake", "certificate", "tls"))


def hint_for(error: DxpoolError, endpoint: str) -> str | None:
    """A next step for ``error``, or None when the message says it all."""
    code = error.code
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (
            "connect with a client certificate (--tls-cert and --tls-key, or cert/key in the "
            "config file) or a bearer token (--token-file), as the broker expects"
        )
    if code == grpc.StatusCode.UNAVAILABLE and _looks_like_tls(error.message):
        return (
            "the TLS handshake failed: check --tls-ca (the CA that signed the broker), your "
            "certificate and key, and that the broker serves TLS"
        )
    if code == grpc.StatusCode.UNAVAILABLE and "socket closed" in error.message.lower():
        return (
            f"the broker at {endpoint} closed the connection: if it serves TLS (as `dxpool "
            "up` does), connect with --tls-ca and a certificate or token, or point "
            "DXPOOL_CONFIG at the config file `dxpool up` wrote (.dxpool/config.yaml)"
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return (
            f"is the broker running at {endpoint}? start one with `dxpool up`, or point "
            "--endpoint (or DXPOOL_ENDPOINT) at a running broker"
        )
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "node plan" not in error.message:
        return "see why each host was dropped with `dxpool node plan` and the same flags"
    if code == grpc.StatusCode.ABORTED:
        return "a concurrent change won; run the command again"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "the broker did not answer in time; raise --request-timeout or check its log"
    return None


def format_error(error: DxpoolError, endpoint: str, *, verbose: bool = False) -> str:
    """The stderr text for an API error: ``error: NOT_FOUND: ...`` plus an optional hint."""
    lines = [f"error: {error.code.name}: {error.message}"]
    if verbose and error.reason:
        details = ", ".join(f"{k}={v}" for k, v in sorted(error.metadata.items()))
        lines.append(f"reason: {error.reason}" + (f" ({details})" if details else ""))
    hint = hint_for(error, endpoint)
    if hint:
        lines.append(f"hint: {hint}")
    return "\n".join(lines)


def for_each(
    names: Iterable[str],
    act: Callable[[str], None],
    endpoint: str,
    *,
    ignore_not_found: bool = False,
) -> None:
    """Run ``act`` on every name, even after one fails; each failure is printed as it
    happens (``error: NAME: CODE: message``) and the command then exits 1. With
    ``ignore_not_found`` a name that does not exist is skipped quietly."""
    failed = 0
    for name in names:
        try:
            act(name)
        except DxpoolError as error:
            if ignore_not_found and isinstance(error, NotFound):
                continue
            failed += 1
            text = format_error(error, endpoint).replace("error: ", f"error: {name}: ", 1)
            click.echo(text, err=True)
    if failed:
        raise click.exceptions.Exit(EXIT_API_ERROR)
