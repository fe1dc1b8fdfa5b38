"""The box fabric a broker is configured with (``--fabric``): the one place its backends
are listed and built.

The contract every backend keeps is :class:`~dxpool.broker.control.box_fabric.BoxFabric`;
the backends import that module, and only this one imports the backends, so the choice
of backend adds no import circle.

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

from dxpool.broker.control.box_fabric import BoxFabric, SimBoxFabric
from dxpool.errors import InvalidArgument
from dxpool.extras import install_hint, missing_modules

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


__all__ = ["SPEC_GRAMMAR", "open_box_fabric"]
