"""A :class:`~dxpool.hostagent.driver.ProxyMapper` that runs an operator's executable.

Proxy vendors differ in how their mapping tables are programmed (a CLI, a REST service, a
kernel module's ioctl). The command hook lets an operator plug any of them in with a small
program. dxpool runs it once per operation and reads its answer; nothing else is shared.

Contract of the hook executable
-------------------------------

It is run without a shell, with one of these argument lists (``HOST`` is the host id,
``BOX`` a box id, ``SLOT`` the GPU's slot in its box, ``HOST_SLOT`` the host-side proxy
slot, ``GENERATION`` the assignment's fencing token, all decimal integers but the ids)::

    HOOK map HOST BOX SLOT HOST_SLOT GENERATION   map the GPU to the host slot
    HOOK unmap HOST BOX SLOT                      drop the GPU's mapping on the host
    HOOK status HOST                              list the host's mappings
    HOOK fence HOST                               revoke every mapping of the host

* ``map`` must be idempotent for the identical mapping; ``unmap`` of a GPU that is not
  mapped on the host and ``fence`` of a host with no mappings succeed.
* ``status`` prints one JSON object on stdout:
  ``{"mappings": [{"host_slot": 0, "box": "b1", "slot": 3}, ...]}``. ``fence`` may print
  ``{"revoked": [{"box": "b1", "slot": 3}, ...]}``, the GPUs it cut off; without it,
  dxpool takes the host's ``status`` listing read just before the fence. The other
  operations may print nothing or any JSON object; an object's ``"message"`` string is
  logged.
* Exit status (:mod:`dxpool.hooks` runs every hook): **0** done; **3** conflict (the GPU
  is mapped at another host slot or the host slot holds another GPU; dxpool detaches the
  holder and retries); **4** refused for good (a fenced generation, an unknown GPU or
  host: not retried); anything else is a transient failure that dxpool retries with
  backoff. Text on stderr is put into the
  error dxpool reports, so make it say what went wrong.
* dxpool may run several hooks at once for different GPUs of the host (one per
  reconcile worker): a hook serializes whatever its proxy needs serialized.
* The hook must finish within the configured timeout (default 30 s). When it does not,
  dxpool kills its whole process group (it runs in a session of its own) and treats the
  operation as a transient failure: the hook must therefore be safe to run again after
  being killed at any point.

The broker runs the same kind of hook at the box side (``--fabric hook:PATH``,
:mod:`dxpool.broker.control.box_fabric_hook`) before it reuses a GPU of a lost host, with two
verbs of its own (no host: they act on the GPU wherever it is mapped)::

    HOOK fence-gpu BOX SLOT GENERATION            revoke the GPU's mappings of GENERATION
                                                  or older (and, where the proxy can,
                                                  refuse maps for them from now on)
    HOOK scrub-gpu BOX SLOT GENERATION            reset the GPU (clear its memory) after
                                                  the assignment of GENERATION

* ``fence-gpu`` succeeds when the GPU is mapped nowhere afterwards, also when it was not
  mapped at all. A mapping made for a *newer* generation belongs to a newer assignment:
  a proxy that records generations leaves it in place and exits 0; one that cannot tell
  generations apart removes whatever maps the GPU (the broker only fences a GPU that no
  newer assignment can hold yet). Exit 0 only once the revocation has taken effect at
  the proxy: the broker hands the GPU to another host after it.
* ``scrub-gpu`` exits 3 when the GPU is still mapped (the broker fences again first) and
  4 when the box cannot reset this GPU (after repeated failures the broker quarantines
  it for an operator).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dxpool.errors import InvalidArgument
from dxpool.hooks import EXIT_CONFLICT, EXIT_OK, EXIT_REFUSED, HookError, HookOutcome, run_hook
from dxpool.hostagent.errors import AttachConflictError, DriverError
from dxpool.names import GpuRef, check_id

log = logging.getLogger(__name__)

DEFAULT_HOOK_TIMEOUT_S = 30.0


class CommandHookMapper:
    """:class:`~dxpool.hostagent.driver.ProxyMapper` for ``host`` through ``hook``.

    ``hook`` is the path of an executable that follows the contract in this module's
    docstring; ``timeout_s`` bounds every run. Every method raises :class:`DriverError`
    (:class:`AttachConflictError` for exit status 3) with the hook's stderr in the message.
    Safe to call from several threads: each call is its own process.
    """

    def __init__(self, hook: Path, host: str, *, timeout_s: float = DEFAULT_HOOK_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._hook = Path(hook)
        self._host = host
        self._timeout_s = timeout_s

    @property
    def hook(self) -> Path:
        return self._hook

    def map(self, gpu: GpuRef, host_slot: int, generation: int) -> None:
        self._run("map", gpu.box, str(gpu.slot), str(host_slot), str(generation))

    def unmap(self, gpu: GpuRef) -> None:
        self._run("unmap", gpu.box, str(gpu.slot))

    def fence(self, host: str) -> list[GpuRef]:
        """Revoke every mapping of ``host`` (this mapper's host, or another host when the
        hook runs on a machine that may program that host's proxy), and return the GPUs
        revoked: the hook's ``"revoked"`` list when it prints one, else the mappings its
        ``status`` listed for ``host`` just before the fence."""
        listed = parse_mappings(self._run_for(host, "status"), self._describe_for(host, "status"))
        answer = self._run_for(host, "fence")
        if "revoked" not in answer:
            return sorted(listed.values())
        return parse_revoked(answer, self._describe_for(host, "fence"))

    def mappings(self) -> dict[int, GpuRef]:
        answer = self._run("status")
        return parse_mappings(answer, self._describe("status"))

    def _describe(self, operation: str) -> str:
        return self._describe_for(self._host, operation)

    def _describe_for(self, host: str, operation: str) -> str:
        return f"proxy hook {self._hook} {operation} for host {host}"

    def _run(self, operation: str, *args: str) -> dict[str, Any]:
        return self._run_for(self._host, operation, *args)

    def _run_for(self, host: str, operation: str, *args: str) -> dict[str, Any]:
        what = self._describe_for(host, operation)
        try:
            return run_hook(
                self._hook, [operation, host, *args], timeout_s=self._timeout_s, what=what
            )
        except HookError as error:
            if error.outcome is HookOutcome.CONFLICT:
                raise AttachConflictError(error.message) from error
            raise DriverError(error.message, retryable=error.retryable) from error


def parse_mappings(answer: dict[str, Any], what: str) -> dict[int, GpuRef]:
    """Host slot -> GPU from a ``status`` answer; :class:`DriverError` naming the bad entry."""
    entries = answer.get("mappings")
    if not isinstance(entries, list):
        raise DriverError(
            f'{what} printed no "mappings" list; expected '
            '{"mappings": [{"host_slot": 0, "box": "b1", "slot": 3}, ...]}'
        )
    table: dict[int, GpuRef] = {}
    for index, entry in enumerate(entries):
        host_slot = entry.get("host_slot") if isinstance(entry, dict) else None
        gpu = _entry_gpu(
            entry,
            f"{what}: mappings[{index}]",
            "host_slot (an integer >= 0), box (a box id) and slot (an integer >= 0)",
            valid=_is_count(host_slot),
        )
        assert isinstance(host_slot, int)
        if host_slot in table:
            raise DriverError(
                f"{what}: host slot {host_slot} is listed twice ({table[host_slot].name} and "
                f"{gpu.name}); a host slot holds one GPU"
            )
        table[host_slot] = gpu
    return table


def parse_revoked(answer: dict[str, Any], what: str) -> list[GpuRef]:
    """The GPUs a ``fence`` answer's ``"revoked"`` list names, in order; :class:`DriverError`
    naming the bad entry."""
    entries = answer.get("revoked")
    if not isinstance(entries, list):
        raise DriverError(
            f'{what}: "revoked" is not a list; expected '
            '{"revoked": [{"box": "b1", "slot": 3}, ...]} or no "revoked" at all'
        )
    revoked = [
        _entry_gpu(entry, f"{what}: revoked[{index}]", "box (a box id) and slot (an integer >= 0)")
        for index, entry in enumerate(entries)
    ]
    return sorted(revoked)


def _entry_gpu(entry: object, where: str, needs: str, *, valid: bool = True) -> GpuRef:
    """The GPU (``box``, ``slot``) of one JSON entry of a hook's answer; :class:`DriverError`
    saying ``where`` it is and what each entry ``needs`` when it is not one (or ``valid``
    is False: a field the caller checks is wrong)."""
    box = entry.get("box") if isinstance(entry, dict) else None
    slot = entry.get("slot") if isinstance(entry, dict) else None
    if not (valid and isinstance(box, str) and _is_count(slot)):
        raise DriverError(f"{where} is {entry!r}; each entry needs {needs}")
    try:
        check_id(box, "box")
    except InvalidArgument as error:
        raise DriverError(f"{where}: {error.message}") from error
    assert isinstance(slot, int)
    return GpuRef(box, slot)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


__all__ = [
    "DEFAULT_HOOK_TIMEOUT_S",
    "EXIT_CONFLICT",
    "EXIT_OK",
    "EXIT_REFUSED",
    "CommandHookMapper",
    "parse_mappings",
]
