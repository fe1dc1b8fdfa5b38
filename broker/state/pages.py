"""Pages of records: one page at a time, resumed from an opaque page token.

A page token is the encoding of the last key handed out, so pages stay correct while
records are added or removed between calls, and a token this broker did not hand out is
INVALID_ARGUMENT. Shared by the services' List calls and the tenants' listing; it lives
with the cache because it pages the cache's sorted records.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Sequence
from typing import TypeVar

from dxpool.broker.state.cache import Collection
from dxpool.errors import InvalidArgument
from dxpool.limits import MAX_PAGE_TOKEN
from dxpool.store.typed import Versioned

T = TypeVar("T")
R = TypeVar("R")


def page(items: Sequence[tuple[str, T]], page_size: int, page_token: str) -> tuple[list[T], str]:
    """One page of ``(sort_key, item)`` pairs sorted by key, and the next page token.

    The token is the opaque encoding of the last key returned, so pages stay correct
    while records are added or removed between calls.
    """
    after = _decode_token(page_token) if page_token else None
    start = 0
    if after is not None:
        start = next((i for i, (key, _) in enumerate(items) if key > after), len(items))
    chunk = items[start : start + page_size]
    more = start + page_size < len(items)
    token = _encode_token(chunk[-1][0]) if more and chunk else ""
    return [item for _, item in chunk], token


def cache_page(
    collection: Collection[R],
    page_size: int,
    page_token: str,
    keep: Callable[[Versioned[R]], bool] = lambda _: True,
) -> tuple[list[tuple[str, Versioned[R]]], str]:
    """One page of the records of ``collection`` (one of the cache's) that ``keep``
    accepts, as ``(id, record)`` in the cache's listing order, and the next page token
    (the last id).

    O(log n + what the page skips): the cache keeps its records sorted, so no call sorts
    the collection. Like :func:`page`, pages stay correct while records come and go.
    """
    after = _decode_token(page_token) if page_token else None
    chunk, more = collection.scan(after, page_size, keep)
    token = _encode_token(chunk[-1][0]) if more and chunk else ""
    return chunk, token


def _encode_token(key: str) -> str:
    return base64.urlsafe_b64encode(("v1:" + key).encode()).decode()


def check_page_token(token: str) -> str:
    """Return ``token`` if it is empty or a page token this broker handed out."""
    if token:
        _decode_token(token)
    return token


def _decode_token(token: str) -> str:
    raw = ""
    if len(token) <= MAX_PAGE_TOKEN and token.isascii():
        try:
            raw = base64.urlsafe_b64decode(token.encode()).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            raw = ""
    if not raw.startswith("v1:"):
        raise InvalidArgument(
            "invalid page_token: pass the next_page_token of the previous response unchanged",
            reason="INVALID_PAGE_TOKEN",
        )
    return raw[3:]


__all__ = ["cache_page", "check_page_token", "page"]
