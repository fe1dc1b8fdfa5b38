"""dxpool.hostagent: the per-host agent that makes a host's GPUs match the broker's spec.

Run one with ``python -m dxpool.hostagent`` (or ``dxpool agent``). The pieces:
:mod:`~dxpool.hostagent.driver` (the fabric driver interface and the step driver),
:mod:`~dxpool.hostagent.nvml` (GPU identity and health), :mod:`~dxpool.hostagent.drivers`
(the driver registry and the simulated-fabric seams), :mod:`~dxpool.hostagent.reconcile`
(per-GPU reconcile), :mod:`~dxpool.hostagent.agent` (threads, watch, registration).
"""

from __future__ import annotations

from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.driver import (
    AttachedGpu,
    AttachRequest,
    DriverCapabilities,
    FabricDriver,
    StepDriver,
)
from dxpool.hostagent.errors import DriverError, IdentityMismatchError

__all__ = [
    "AgentConfig",
    "AttachRequest",
    "AttachedGpu",
    "DriverCapabilities",
    "DriverError",
    "FabricDriver",
    "IdentityMismatchError",
    "StepDriver",
]
