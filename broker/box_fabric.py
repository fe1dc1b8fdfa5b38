"""The box side of the fabric, as the broker (the fencer) sees it.

Fencing is done at the box side, never by the host's agent: the agent of a lost host is
exactly the party that cannot be trusted to act. Both operations carry the GPU's
generation, the fencing token of one assignment:

* :meth:`BoxFabric.fence` revokes every mapping of the GPU made for that generation or an
  older one and refuses such mappings from then on - so a frozen agent that wakes up
  mid-attach cannot map the GPU again, while a newer assignment's mapping is untouched
  (a deposed leader's late fence is harmless);
* :meth:`BoxFabric.scrub` resets the GPU from the box side once nothing maps it, so no
  tenant's memory reaches the next tenant.

Both are idempotent. :func:`open_box_fabric` builds the backend a broker is configured
with (``sim:DIR`` today; vendor backends plug in behind the same protocol).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from dxpool.errors import InvalidArgument
from dxpool.fabric.sim import SimFabric, SimFabricError
from dxpool.names import GpuRef


class BoxFabricError(Exception):
    """A box-side operation failed; it is retried, and a GPU that keeps failing it is
    quarantined."""


class BoxFabric(Protocol):
    def fence(self, gpu: GpuRef, generation: int) -> None:
        """Revoke mappings of ``gpu`` made for ``generation`` or older, and refuse them
        from now on. Raises :class:`BoxFabricError`."""
        ...

    def scrub(self, gpu: GpuRef, generation: int) -> None:
        """Reset ``gpu`` (clear its memory) after the assignment of ``generation``.
        Raises :class:`BoxFabricError`, also when something still maps the GPU."""
        ...


class SimBoxFabric:
    """:class:`BoxFabric` over the simulated fabric in a state directory. The fabric is
    opened per call (cheap), so the broker may start before the fabric is installed."""

    def __init__(self, state_dir: Path) -> None:
        self._state_dir = state_dir

    def fence(self, gpu: GpuRef, generation: int) -> None:
        try:
            SimFabric(self._state_dir).fence(gpu.box, gpu.slot, generation)
        except SimFabricError as error:
            raise BoxFabricError(str(error)) from error

    def scrub(self, gpu: GpuRef, generation: int) -> None:
        try:
            SimFabric(self._state_dir).scrub(gpu.box, gpu.slot, generation)
        except SimFabricError as error:
            raise BoxFabricError(str(error)) from error


def open_box_fabric(spec: str | None) -> BoxFabric | None:
    """The backend named by ``spec`` (``sim:DIR``), or None when none is configured."""
    if not spec:
        return None
    kind, _, target = spec.partition(":")
    if kind == "sim" and target:
        return SimBoxFabric(Path(target))
    raise InvalidArgument(
        f"unknown box fabric {spec!r}: expected sim:DIR (the simulated fabric's state directory)"
    )


__all__ = ["BoxFabric", "BoxFabricError", "SimBoxFabric", "open_box_fabric"]
