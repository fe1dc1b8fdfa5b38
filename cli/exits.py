"""The ``dxpool`` command's exit statuses (a module of its own, so the root imports it
without the error formatting's gRPC)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_API_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

__all__ = ["EXIT_API_ERROR", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE"]
