"""The proxy hook program of the emulated fabric (:mod:`tests.kernel.qemu_fabric`).

Run as ``fabric_hook.py HOST:PORT VERB ARGS...`` (through a wrapper that names the
address), it sends the verb to the fabric and exits with the fabric's status, printing
its output, so both the agent in a guest (``--proxy-hook``) and the broker
(``--fabric hook:``) use it under the command-hook contract. Standard library only.
"""

from __future__ import annotations

import json
import socket
import sys

TIMEOUT_S = 600.0


def main(argv: list[str]) -> int:
    host, _, port = argv[1].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as connection:
            connection.sendall(json.dumps({"argv": argv[2:]}).encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = connection.recv(65536)
                if not chunk:
                    break
                reply += chunk
    except OSError as error:
        print(f"the fabric at {argv[1]} is not reachable: {error}", file=sys.stderr)
        return 1
    if not reply:
        print(f"the fabric at {argv[1]} closed without an answer", file=sys.stderr)
        return 1
    answer = json.loads(reply)
    sys.stdout.write(answer["stdout"])
    sys.stderr.write(answer["stderr"])
    return int(answer["rc"])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
