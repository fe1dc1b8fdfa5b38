"""Errors raised by fabric drivers and their seams.

Hierarchy::

    DriverError                 a hardware step failed; ``retryable`` says if a retry can help
    ├── DeviceTimeoutError      the PCI device did not appear on the host bus in time
    ├── AttachConflictError     the GPU is mapped at another host slot, or the host slot holds
    │                           another GPU (retryable: the holder is detached first)
    ├── GpuBusyError            compute processes still run on the GPU; not detached unless
    │                           forced (retryable: they may exit)
    └── IdentityMismatchError   the device is not the GPU asked for (not retryable)

The reconciler retries retryable errors with backoff and reports the others at once.
Messages name the GPU, slot or device and say what went wrong.
"""

from __future__ import annotations


class DriverError(Exception):
    """A hardware step failed. ``retryable`` is False when repeating it cannot succeed."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable


class DeviceTimeoutError(DriverError):
    """The PCI device did not appear within the timeout after a rescan."""


class AttachConflictError(DriverError):
    """The GPU is mapped at another host slot, or the host slot holds another GPU."""


class GpuBusyError(DriverError):
    """Compute processes still run on the GPU (``pids``), so it was not detached."""

    def __init__(self, message: str, pids: tuple[int, ...]) -> None:
        super().__init__(message, retryable=True)
        self.pids = pids


class IdentityMismatchError(DriverError):
    """NVML reports a different GPU (UUID or model) than the attachment asked for."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class ScrubError(DriverError):
    """The GPU is not healthy after its reset: it must not reach another tenant."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


__all__ = [
    "AttachConflictError",
    "DeviceTimeoutError",
    "DriverError",
    "GpuBusyError",
    "IdentityMismatchError",
    "ScrubError",
]
