"""How the pipeline calls plugins: a plugin's exception never escapes the pipeline.

A plugin that raises while judging one candidate (a host, a link) drops that candidate
with an ``ERROR`` status naming the plugin; one that raises in a phase that concerns
every host stops the run with :class:`PluginError`, which the pipeline reports as an
internal reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from dxpool.broker.placement.framework import FilterPlugin
from dxpool.broker.placement.model import PlacementRequest
from dxpool.broker.placement.status import Status

F = TypeVar("F", bound=FilterPlugin)


class PluginError(Exception):
    """A plugin raised in a phase that concerns every host; the run cannot go on."""

    def __init__(self, plugin: str, error: BaseException) -> None:
        super().__init__(plugin, error)
        self.plugin = plugin
        self.error = f"{type(error).__name__}: {error}"


def failure(plugin: str, error: BaseException) -> Status:
    """The ERROR status for an exception raised by ``plugin``."""
    return Status.error(
        f"placement plugin {plugin} failed: {type(error).__name__}: {error}", plugin=plugin
    )


def guarded(plugin: str, call: Callable[..., Status], *args: object) -> Status:
    """Calls a plugin phase; an exception becomes an ERROR status naming the plugin."""
    try:
        return call(*args)
    except Exception as error:
        return failure(plugin, error)


def guarded_text(plugin: str, call: Callable[..., str | None], *args: object) -> str | None:
    """Calls a plugin's explain; an exception becomes a line saying it could not."""
    try:
        return call(*args)
    except Exception as error:
        return f"placement plugin {plugin} could not explain: {type(error).__name__}: {error}"


def applying(plugins: tuple[F, ...], request: PlacementRequest) -> tuple[F, ...]:
    """The plugins whose ``applies(request)`` is true, in order; raises
    :class:`PluginError` naming the first one that raises."""
    try:
        return tuple(plugin for plugin in plugins if plugin.applies(request))
    except Exception:
        pass
    for plugin in plugins:  # find which one failed, to name it
        try:
            plugin.applies(request)
        except Exception as error:
            raise PluginError(plugin.name, error) from error
    return tuple(plugin for plugin in plugins if plugin.applies(request))
