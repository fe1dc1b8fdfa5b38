"""The broker's box fabric through an operator's hook executable (``--fabric hook:PATH``).

The hook follows the command-hook contract the host agent's proxy hook follows (written
down in :mod:`dxpool.hostagent.drivers.command_hook`, run by :mod:`dxpool.hooks`), with
the two box-side verbs::

    HOOK fence-gpu BOX SLOT GENERATION
    HOOK scrub-gpu BOX SLOT GENERATION

``fence-gpu`` exits 0 only once no mapping of ``GENERATION`` or older reaches the GPU;
``scrub-gpu`` exits 0 once the GPU was reset. Any other exit (3 conflict, 4 refused, a
transient failure, a timeout, output that is not a JSON object) is a
:class:`~dxpool.broker.control.box_fabric.BoxFabricError` carrying the hook's stderr: the broker
keeps the GPU in FENCING, tries again with backoff and quarantines it after repeated
failures. Generations are the hook's to enforce: the broker passes the token, and a
proxy that records the generation of each mapping can leave a newer one alone and
refuse late maps of a fenced one, which the Redfish backend cannot.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from dxpool.broker.control.box_fabric import BoxFabricError
from dxpool.errors import InvalidArgument
from dxpool.hooks import HookError, run_hook
from dxpool.names import GpuRef

log = logging.getLogger(__name__)

DEFAULT_FABRIC_HOOK_TIMEOUT_S = 30.0
FENCE = "fence-gpu"
SCRUB = "scrub-gpu"


class HookBoxFabric:
    """:class:`~dxpool.broker.control.box_fabric.BoxFabric` that runs ``hook`` once per operation,
    each run bounded by ``timeout_s``. Safe for several threads: each call is a process."""

    def __init__(self, hook: Path, *, timeout_s: float = DEFAULT_FABRIC_HOOK_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise InvalidArgument(f"the box fabric hook's timeout must be > 0, got {timeout_s:g}")
        if not hook.is_file() or not os.access(hook, os.X_OK):
            raise InvalidArgument(
                f"box fabric hook {str(hook)!r} is not an executable file; give the path of "
                "a program that follows the command-hook contract (fence-gpu, scrub-gpu)"
            )
        self._hook = hook
        self._timeout_s = timeout_s

    @property
    def hook(self) -> Path:
        return self._hook

    def fence(self, gpu: GpuRef, generation: int) -> None:
        self._run(FENCE, gpu, generation)
        log.warning("gpu fenced at the box side", extra={"gpu": gpu.name, "generation": generation})

    def scrub(self, gpu: GpuRef, generation: int) -> None:
        self._run(SCRUB, gpu, generation)
        log.info("gpu reset at the box side", extra={"gpu": gpu.name, "generation": generation})

    def close(self) -> None:
        """Nothing to release: every call is a process of its own."""

    def _run(self, verb: str, gpu: GpuRef, generation: int) -> None:
        what = f"box fabric hook {self._hook} {verb} for {gpu.name} generation {generation}"
        try:
            run_hook(
                self._hook,
                [verb, gpu.box, str(gpu.slot), str(generation)],
                timeout_s=self._timeout_s,
                what=what,
            )
        except HookError as error:
            raise BoxFabricError(error.message) from error


__all__ = ["DEFAULT_FABRIC_HOOK_TIMEOUT_S", "HookBoxFabric"]
