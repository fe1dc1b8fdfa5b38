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

Both are idempotent. :func:`open_box_fabric` builds the backend a broker is configured
with (``--fabric``), the one place backends are listed:

============== ======================================================================
``sim:DIR``    the simulated fabric in a state directory (``dxpool up``, tests)
``redfish:MAP`` a DMTF Redfish fabric manager, described by the agents' YAML fabric map
               (:mod:`dxpool.broker.control.box_fabric_redfish`)
``hook:PATH``  an operator's executable, ``fence-gpu`` / ``scrub-gpu`` verbs of the
               command-hook contract (:mod:`dxpool.broker.control.box_fabric_hook`)
============== ======================================================================

Each backend's docstring says how it holds the generation part of the contract; the
Redfish one cannot record generations and relies on the broker's order of work instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from dxpool.errors import InvalidArgument
from dxpool.extras import install_hint, missing_modules
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


SPEC_GRAMMAR = (
    "sim:DIR (the simulated fabric's state directory), redfish:FILE (the Redfish fabric map "
    "the agents use) or hook:PATH (an executable with the fence-gpu and scrub-gpu verbs)"
)


def open_box_fabric(spec: str | None, *, hook_timeout_s: float | None = None) -> BoxFabric | None:
    """The backend named by ``spec``, or None when none is configured.

    ``hook_timeout_s`` bounds each run of a ``hook:`` backend (default 30 s). Reads and
    checks what the spec names (the fabric map and its password file, the hook's
    executable bit) but connects to nothing, so a broker starts while its fabric manager
    is away. Raises :class:`InvalidArgument` for a spec or file that cannot work.
    """
    if not spec:
        return None
    kind, _, target = spec.partition(":")
    if kind == "sim" and target:
        return SimBoxFabric(Path(target))
    if kind == "redfish" and target:
        missing = missing_modules("server")
        if "redfish" in missing:
            raise InvalidArgument(
                f"--fabric {spec}: the Redfish box fabric needs the redfish module: "
                f"{install_hint('server')}"
            )
        from dxpool.broker.control.box_fabric_redfish import RedfishBoxFabric
        from dxpool.redfish.fabric_map import load_fabric_map

        return RedfishBoxFabric(load_fabric_map(Path(target)))
    if kind == "hook" and target:
        from dxpool.broker.control.box_fabric_hook import (
            DEFAULT_FABRIC_HOOK_TIMEOUT_S,
            HookBoxFabric,
        )

        timeout_s = DEFAULT_FABRIC_HOOK_TIMEOUT_S if hook_timeout_s is None else hook_timeout_s
        return HookBoxFabric(Path(target), timeout_s=timeout_s)
    raise InvalidArgument(f"unknown box fabric {spec!r}: expected {SPEC_GRAMMAR}")


__all__ = ["BoxFabric", "BoxFabricError", "SimBoxFabric", "open_box_fabric"]
