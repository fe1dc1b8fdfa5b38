"""How API errors reach the operator: ``error: CODE: message`` and, where useful, a hint.

The hint says what to do next (start a broker, look at the plan, retry), the way a
colleague would; it never repeats the message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import click
import grpc

from dxpool.cli.exits import EXIT_API_ERROR
from dxpool.errors import DxpoolError, NotFound

MAX_CONCURRENT_WAITS = 16
"""How many names a command with ``--wait`` acts on at once (each holds a watch)."""


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
    act: Callable[[str], str | None],
    endpoint: str,
    *,
    ignore_not_found: bool = False,
    concurrency: int = 1,
) -> None:
    """Run ``act`` on every name, even after one fails, and print what each returns (a
    line for stdout, or None) in the order the names were given. Each failure is printed
    in its place (``error: NAME: CODE: message``) and the command then exits 1. With
    ``ignore_not_found`` a name that does not exist is skipped quietly.

    With ``concurrency`` above 1, up to that many names are acted on at once (each
    ``act`` must then be safe to run beside the others, as calls on one client are): a
    wait for one name no longer holds up the next one's request."""
    ordered = list(names)
    failed = 0

    def report(name: str, outcome: Future[str | None]) -> None:
        nonlocal failed
        try:
            line = outcome.result()
        except DxpoolError as error:
            if ignore_not_found and isinstance(error, NotFound):
                return
            failed += 1
            text = format_error(error, endpoint).replace("error: ", f"error: {name}: ", 1)
            click.echo(text, err=True)
            return
        except TimeoutError as error:  # a --wait that ran out; the others go on
            failed += 1
            click.echo(f"error: {name}: DEADLINE_EXCEEDED: {error}", err=True)
            return
        if line is not None:
            click.echo(line)

    if concurrency <= 1 or len(ordered) <= 1:
        for name in ordered:
            outcome: Future[str | None] = Future()
            try:
                outcome.set_result(act(name))
            except (DxpoolError, TimeoutError) as error:
                outcome.set_exception(error)
            report(name, outcome)
    else:
        with ThreadPoolExecutor(max_workers=min(concurrency, len(ordered))) as pool:
            outcomes = [(name, pool.submit(act, name)) for name in ordered]
            try:
                for name, outcome in outcomes:
                    report(name, outcome)
            except BaseException:  # Ctrl-C: do not start the names still queued
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    if failed:
        raise click.exceptions.Exit(EXIT_API_ERROR)
