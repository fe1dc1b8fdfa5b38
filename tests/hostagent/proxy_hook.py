"""A proxy hook executable for tests: a real program that follows the command-hook
contract (:mod:`dxpool.hostagent.drivers.command_hook`) over a JSON mapping table.

:func:`write_proxy_hook` writes it next to its table; :func:`read_table` reads the table
back, so a test (or a fake sysfs tree) sees what the proxy maps. The same program answers
the broker's box-side verbs (``fence-gpu``, ``scrub-gpu``): it keeps the highest fenced
generation of each GPU and refuses maps for it (exit 4), like a token-fencing proxy, and
logs each box-side operation (:func:`box_log`); :func:`fail_box_side` makes them fail.
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
FENCED = TABLE + ".fenced"
BOX_LOG = TABLE + ".box-log"


def load(path, empty):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return empty


def save(path, value):
    import os
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def box_side(operation, box, slot, generation, table):
    # The broker's verbs: revoke the GPU's mappings of `generation` or older wherever
    # they are and refuse maps of those generations from now on; reset the GPU.
    import os
    if os.path.exists(TABLE + ".fail-" + operation):
        print(f"{{operation}} {{box}}/{{slot}}: injected failure", file=sys.stderr)
        return 1
    fenced = load(FENCED, {{}})
    log = load(BOX_LOG, [])
    key = f"{{box}}/{{slot}}"
    holders = [
        (host, host_slot, m)
        for host, mappings in table.items()
        for host_slot, m in mappings.items()
        if (m["box"], m["slot"]) == (box, slot)
    ]
    if operation == "fence-gpu":
        for host, host_slot, m in holders:
            if m["generation"] <= generation:
                del table[host][host_slot]
        fenced[key] = max(fenced.get(key, -1), generation)
        save(TABLE, table)
        save(FENCED, fenced)
    else:
        if holders:
            print(f"{{key}} is mapped to {{holders[0][0]}}", file=sys.stderr)
            return 3
    log.append({{"op": operation, "gpu": key, "generation": generation,
                "mapped": [[h, int(s)] for h, s, _ in holders]}})
    save(BOX_LOG, log)
    return 0


def main(argv):
    operation = argv[1]
    with open(TABLE + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = load(TABLE, {{}})
        if operation in ("fence-gpu", "scrub-gpu"):
            return box_side(operation, argv[2], int(argv[3]), int(argv[4]), table)
        host, args = argv[2], argv[3:]
        mappings = table.setdefault(host, {{}})
        if operation == "status":
            print(json.dumps({{"mappings": [
                {{"host_slot": int(s), "box": m["box"], "slot": m["slot"]}}
                for s, m in sorted(mappings.items())
            ]}}))
            return 0
        if operation == "map":
            box, slot, host_slot, generation = args[0], int(args[1]), args[2], int(args[3])
            if generation <= load(FENCED, {{}}).get(f"{{box}}/{{slot}}", -1):
                print(f"generation {{generation}} of {{box}}/{{slot}} is fenced", file=sys.stderr)
                return 4
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


def box_log(hook: Path) -> list[dict[str, object]]:
    """Every fence-gpu and scrub-gpu the hook next to it carried out, in order, with the
    (host, host slot) pairs that mapped the GPU when it ran."""
    try:
        return list(json.loads((hook.parent / "table.json.box-log").read_text()))
    except FileNotFoundError:
        return []


def fail_box_side(hook: Path, verb: str, failing: bool) -> None:
    """Make the hook's ``verb`` (fence-gpu, scrub-gpu) fail (exit 1) until called again
    with ``failing=False``."""
    marker = hook.parent / f"table.json.fail-{verb}"
    if failing:
        marker.touch()
    else:
        marker.unlink(missing_ok=True)


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
