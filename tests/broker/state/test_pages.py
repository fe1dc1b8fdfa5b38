"""Page tokens: every item once, resumable across deletions, garbage refused."""

from __future__ import annotations

import pytest

from dxpool.broker.state.pages import page
from dxpool.errors import InvalidArgument


def test_pages_walk_every_item_once() -> None:
    items = [(f"k{i:03d}", i) for i in range(25)]
    seen, token = [], ""
    while True:
        chunk, token = page(items, 10, token)
        seen.extend(chunk)
        if not token:
            break
    assert seen == list(range(25))


def test_page_token_survives_deletions() -> None:
    items = [(f"k{i}", i) for i in range(6)]
    first, token = page(items, 3, "")
    remaining = [item for item in items if item[1] != 3]
    second, _ = page(remaining, 3, token)
    assert first == [0, 1, 2] and second == [4, 5]


def test_garbage_page_token_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="next_page_token"):
        page([], 10, "not-a-token")
