"""``stdio_relay.py PORT``: relay stdin/stdout to ``127.0.0.1:PORT``, both ways, until
either side closes. QEMU runs it for each connection the guest opens to a forwarded
port (``guestfwd=...-cmd:``), so the guest reaches that one loopback service and nothing
else, with as many connections as it likes. Standard library only."""

from __future__ import annotations

import os
import selectors
import socket
import sys


def main(port: int) -> None:
    upstream = socket.create_connection(("127.0.0.1", port))
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "guest")
    selector.register(upstream, selectors.EVENT_READ, "host")
    while True:
        for key, _ in selector.select():
            if key.data == "guest":
                data = os.read(sys.stdin.fileno(), 65536)
                if not data:
                    upstream.shutdown(socket.SHUT_WR)
                    selector.unregister(sys.stdin.fileno())
                    continue
                upstream.sendall(data)
            else:
                data = upstream.recv(65536)
                if not data:
                    return
                view = memoryview(data)
                while view:
                    view = view[os.write(sys.stdout.fileno(), view) :]


if __name__ == "__main__":
    main(int(sys.argv[1]))
