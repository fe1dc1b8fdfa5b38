"""A proxy hook executable for tests: a real program that follows the command-hook
contract (:mod:`dxpool.hostagent.drivers.command_hook`) over a JSON mapping table.

:func:`write_proxy_hook` writes it next to its table; :func:`read_table` reads the table
back, so a test (or a fake sysfs tree) sees what the proxy maps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dxpool.names import GpuRef

HOOK_SOURCE = r"""
import fcntl
import json
import sys

TABLE = {table!r}


def main(argv):
    operation, host, args = argv[1], argv[2], argv[3:]
    with open(TABLE + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(TABLE) as f:
                table = json.load(f)
        except FileNotFoundError:
            table = {{}}
        mappings = table.setdefault(host, {{}})
        if operation == "status":
            print(json.dumps({{"mappings": [
                {{"host_slot": int(s), "box": m["box"], "slot": m["slot"]}}
                for s, m in sorted(mappings.items())
            ]}}))
            return 0
        if operation == "map":
            box, slot, host_slot, generation = args[0], int(args[1]), args[2], int(args[3])
            for other_host, other in table.items():
                for other_slot, m in other.items():
                    same_gpu = (m["box"], m["slot"]) == (box, slot)
                    if same_gpu and (other_host, other_slot) != (host, host_slot):
                        print(f"{{box}}/{{slot}} is mapped to {{other_host}} slot {{other_slot}}",
                              file=sys.stderr)
                        return 3
            held = mappings.get(host_slot)
            if held is not None and (held["box"], held["slot"]) != (box, slot):
                holder = f"{{held['box']}}/{{held['slot']}}"
                print(f"host slot {{host_slot}} holds {{holder}}", file=sys.stderr)
                return 3
            mappings[host_slot] = {{"box": box, "slot": slot, "generation": generation}}
        elif operation == "unmap":
            box, slot = args[0], int(args[1])
            for key in [s for s, m in mappings.items() if (m["box"], m["slot"]) == (box, slot)]:
                del mappings[key]
        elif operation == "fence":
            revoked = [{{"box": m["box"], "slot": m["slot"]}} for m in mappings.values()]
            mappings.clear()
        else:
            print(f"unknown operation {{operation}}", file=sys.stderr)
            return 4
        with open(TABLE + ".tmp", "w") as f:
            json.dump(table, f)
        import os
        os.replace(TABLE + ".tmp", TABLE)
        answer = {{"message": f"{{operation}} done"}}
        if operation == "fence":
            answer["revoked"] = revoked
        print(json.dumps(answer))
        return 0


sys.exit(main(sys.argv))
"""


def write_script(path: Path, body: str) -> Path:
    """An executable Python script at ``path`` running ``body`` with this interpreter."""
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


def write_proxy_hook(directory: Path) -> Path:
    """A working proxy hook in ``directory`` keeping its table in ``table.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    return write_script(
        directory / "proxy-hook", HOOK_SOURCE.format(table=str(directory / "table.json"))
    )


def read_table(hook: Path) -> dict[str, dict[int, GpuRef]]:
    """Host -> host slot -> GPU, as the hook next to it keeps them."""
    try:
        raw = json.loads((hook.parent / "table.json").read_text())
    except FileNotFoundError:
        return {}
    return {
        host: {int(slot): GpuRef(m["box"], m["slot"]) for slot, m in mappings.items()}
        for host, mappings in raw.items()
    }
