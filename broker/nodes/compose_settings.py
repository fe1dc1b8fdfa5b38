"""How the node write paths commit: the settings compose, gang and resize share.

A module of its own so that :mod:`~dxpool.broker.nodes.gang` and
:mod:`~dxpool.broker.nodes.resize`, which :mod:`~dxpool.broker.nodes.compose` builds on,
take their settings without importing compose back.
"""

from __future__ import annotations

from dataclasses import dataclass

from dxpool.broker.state.stm import PLACE_ATTEMPTS


@dataclass(frozen=True)
class ComposeSettings:
    """``attach_timeout_s``: how long a composed node may take to become READY before the
    node controller fails it; ``max_attempts``: how many times a commit whose compare lost
    is placed and tried again before the call fails.
    """

    attach_timeout_s: float = 120.0
    max_attempts: int = PLACE_ATTEMPTS
