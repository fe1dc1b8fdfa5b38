"""Quiet gRPC's C core in dxpool's own processes; entry points import this first.

The C core reads ``GRPC_VERBOSITY`` once, when ``grpc`` is first imported, and its
default prints INFO lines such as one "Handshake failed" per plaintext connection
attempt to a TLS broker, unstructured, on the terminal of ``dxpool up`` and in every
broker's log. Entry points (the ``dxpool`` command, ``python -m dxpool.broker``,
``python -m dxpool.hostagent``) import this module before anything imports ``grpc``, so
only the core's errors are printed; child processes (``dxpool up``'s agents) inherit it.
An operator who sets ``GRPC_VERBOSITY`` keeps their setting. The library
(``dxpool.client``) does not import this: it leaves its host process's logging alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
