"""The box side of the fabric, as the broker (the fencer) sees it.

Fencing is done at the box side, never by the host's agent: the agent of a lost host is
exactly the party that cannot be trusted to act. Both operations carry the GPU's
generation, the fencing token of one assignment:

* :meth:`BoxFabric.fence` revokes every mapping of the GPU made for that generation or an
  older one and refuses such mappings from then on - so a frozen agent that wakes up
  mid-attach cannot map the GPU again, while a newer assignment's mapping is untouched
  (a deposed leader's late fence is harmless). A backend whose box side keeps no
  generations (Redfish zones) revokes every mapping of the GPU instead and cannot refuse
  late ones; it relies on the broker calling ``fence`` only for a GPU that is FENCING at
  that generation, which no newer assignment can hold (its module says what that does
  and does not cover). Either way ``fence`` returns only once the revocation has taken
  effect: the broker frees the GPU after it;
* :meth:`BoxFabric.scrub` resets the GPU from the box side once nothing maps it, so no
  tenant's memory reaches the next tenant.

Both are idempotent. :mod:`~dxpool.broker.control.box_fabrics` builds the backend a
broker is configured with (``--fabric``); each backend's docstring says how it holds the
generation part of the contract.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from dxpool.fabric.sim import SimFabric, SimFabricError
from dxpool.names import GpuRef


class BoxFabricError(Exception):
    """A box-side operation failed; it is retried, and a GPU that keeps failing it is
    quarantined."""


class BoxFabric(Protocol):
    def fence(self, gpu: GpuRef, generation: int) -> None:
        """Revoke mappings of ``gpu`` made for ``generation`` or older, and refuse them
        from now on where the box side records generations; return only once they are
        gone. Idempotent. Raises :class:`BoxFabricError`."""
        ...

    def scrub(self, gpu: GpuRef, generation: int) -> None:
        """Reset ``gpu`` (clear its memory) after the assignment of ``generation``.
        Raises :class:`BoxFabricError`, also when something still maps the GPU."""
        ...

    def close(self) -> None:
        """Release what the backend holds (a session); idempotent."""
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

    def close(self) -> None:
        """Nothing to release: the fabric is opened per call."""


__all__ = ["BoxFabric", "BoxFabricError", "SimBoxFabric"]
