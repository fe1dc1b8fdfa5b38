"""Fixtures for the Redfish conformance tests: DMTF's Mockup Server serving DMTF's
mockups (skipped with the reason where they are absent), and the recording proxy."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.redfish.mockup import MockupServer, locate, mockup_server
from tests.redfish.proxy import RecordingProxy, Rules, running


@pytest.fixture(scope="session")
def mockups_root() -> Path:
    root, why = locate()
    if root is None:
        pytest.skip(why)
    return root


@pytest.fixture
def mockup(mockups_root: Path, tmp_path: Path) -> Iterator[Callable[[str], MockupServer]]:
    """Start a Mockup Server serving the named mockup, fresh (its changes live in its
    memory); every one started is stopped at the end of the test."""
    with ExitStack() as stack:

        def start(name: str) -> MockupServer:
            return stack.enter_context(mockup_server(mockups_root, name, tmp_path))

        yield start


@pytest.fixture
def proxied() -> Iterator[Callable[[MockupServer, Rules], RecordingProxy]]:
    """Put a recording proxy with the given rules in front of a Mockup Server."""
    with ExitStack() as stack:

        def start(server: MockupServer, rules: Rules) -> RecordingProxy:
            return stack.enter_context(running(server.url, rules))

        yield start
