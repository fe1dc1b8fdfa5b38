"""The simulated fabric: GPU boxes, host proxy cards and host PCIe buses, in a directory.

It is the demo and test backend of dxpool and behaves like the hardware it stands for. A
GPU becomes usable on a host in the same steps as on a real fabric::

    fabric.map("b1", 0, "h1", 0)        # program the box-side and host-side proxy tables
    fabric.rescan("h1")                 # the host's PCIe bus finds the GPU; nvidia binds
    [device] = fabric.devices("h1")     # 0000:41:00.0, driver "nvidia"
    fabric.identity("h1", device.bdf)   # what NVML reports: UUID, serial, model, health

The state is shared: every process that opens the same ``state_dir`` sees one fabric, and
the fabric outlives them all. Each operation is a read-modify-write of one JSON document
under an exclusive ``fcntl.flock`` (see :mod:`dxpool.fabric._state_file`), so concurrent
operations from any number of processes and threads serialize and never lose an update.
Delays (:class:`SimDelays`) belong to the calling process and are spent before the lock is
taken, so a slow operation in one process does not stall the others.

Injected faults live in the state too, so a test can inject a fault that an agent running
in another process hits.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from dxpool.errors import InvalidArgument
from dxpool.fabric._sim_state import DeviceRecord, FabricState, FaultRecord
from dxpool.fabric._sim_types import (
    DRIVERS,
    MAX_HOST_SLOTS,
    NO_DELAYS,
    Fenced,
    InjectedFault,
    MappingConflict,
    SimDelays,
    SimDevice,
    SimFabricError,
    SimGpuSpec,
    SimIdentity,
    UnknownTarget,
    bdf_for,
    gpu_serial,
    gpu_uuid,
)
from dxpool.fabric._state_file import LockedJsonFile
from dxpool.names import check_id

__all__ = [
    "FAULT_OPS",
    "Fenced",
    "InjectedFault",
    "MappingConflict",
    "SimDelays",
    "SimDevice",
    "SimFabric",
    "SimFabricError",
    "SimGpuSpec",
    "SimIdentity",
    "UnknownTarget",
]

STATE_FILE = "fabric.json"
LOCK_FILE = "fabric.lock"
FAULT_OPS = frozenset({"map", "unmap", "rescan", "bind", "identity", "fence", "scrub", "reset"})


class SimFabric:
    """A handle on the simulated fabric in ``state_dir``; cheap to create, many may exist.

    Raises :class:`UnknownTarget` if ``state_dir`` holds no fabric (see :meth:`create`).
    Every method is safe to call concurrently from several processes and threads.
    """

    def __init__(self, state_dir: Path, delays: SimDelays = NO_DELAYS) -> None:
        self.state_dir = Path(state_dir)
        self.delays = delays
        self._file = LockedJsonFile(self.state_dir / STATE_FILE, self.state_dir / LOCK_FILE)
        if not self._file.exists():
            raise UnknownTarget(
                f"no simulated fabric in {self.state_dir}: create one with SimFabric.create()"
            )

    def __repr__(self) -> str:
        return f"SimFabric({str(self.state_dir)!r})"

    # installation -----------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        state_dir: Path,
        *,
        boxes: Mapping[str, Sequence[SimGpuSpec]],
        hosts: Mapping[str, int],
        delays: SimDelays = NO_DELAYS,
    ) -> SimFabric:
        """Create a fabric in ``state_dir`` (made if missing), replacing any fabric there.

        ``boxes`` maps a box id to the GPUs in its slots 0..n-1; ``hosts`` maps a host id
        to its number of proxy slots. Nothing is mapped and no host has devices.
        """
        state = FabricState()
        for box, gpus in boxes.items():
            state.boxes[_check_box_id(box)] = _check_gpus(box, gpus)
        for host, slots in hosts.items():
            state.hosts[_check_host_id(host)] = _check_slot_count(host, slots)
        directory = Path(state_dir)
        directory.mkdir(parents=True, exist_ok=True)
        file = LockedJsonFile(directory / STATE_FILE, directory / LOCK_FILE)
        with file.locked():
            file.store(state.to_json())
        return cls(directory, delays)

    def add_box(self, box: str, gpus: Sequence[SimGpuSpec]) -> None:
        """Install a box. Idempotent when the same box is installed again with the same
        GPUs; a different box under the same id is an error (remove nothing implicitly)."""
        specs = _check_gpus(_check_box_id(box), gpus)
        with self._transaction() as state:
            existing = state.boxes.get(box)
            if existing is not None and existing != specs:
                raise SimFabricError(
                    f"box {box!r} is already installed with other GPUs "
                    f"({_describe(existing)}); use another box id"
                )
            state.boxes[box] = specs

    def add_host(self, host: str, slots: int) -> None:
        """Install a host with ``slots`` proxy slots. Idempotent for the same slot count;
        another slot count under the same id is an error."""
        count = _check_slot_count(_check_host_id(host), slots)
        with self._transaction() as state:
            existing = state.hosts.get(host)
            if existing is not None and existing != count:
                raise SimFabricError(
                    f"host {host!r} is already installed with {existing} proxy slots, "
                    f"not {count}; use another host id"
                )
            state.hosts[host] = count

    def boxes(self) -> dict[str, list[SimGpuSpec]]:
        """Every installed box: its GPUs by slot."""
        return {box: list(gpus) for box, gpus in self._snapshot().boxes.items()}

    def hosts(self) -> dict[str, int]:
        """Every installed host: its number of proxy slots."""
        return dict(self._snapshot().hosts)

    # proxy mapping tables -----------------------------------------------------------------

    def map(self, box: str, slot: int, host: str, host_slot: int, *, generation: int = 0) -> None:
        """Map the GPU in ``slot`` of ``box`` to ``host_slot`` of ``host``.

        ``generation`` is the fencing token of the assignment the mapping is for: the box
        side refuses it (:class:`Fenced`) when that generation has been fenced.
        Idempotent for the identical mapping. Raises :class:`MappingConflict` if the GPU
        is mapped elsewhere or the host slot holds another GPU, :class:`UnknownTarget` for
        an unknown box, slot, host or host slot. The GPU is not visible on the host until
        the host's bus is rescanned.
        """
        self._sleep(self.delays.map_s)
        with self._transaction() as state:
            _require_gpu(state, box, slot)
            _require_host_slot(state, host, host_slot)
            fault = state.take_fault("map", box=box, slot=slot, host=host)
            fenced = state.fenced.get((box, slot), -1)
            if fault is None and generation <= fenced:
                raise Fenced(
                    f"GPU {box}/{slot} was fenced at generation {fenced}; a mapping for "
                    f"generation {generation} is refused (the assignment is stale)"
                )
            if fault is None:
                current = state.mappings.get((box, slot))
                if current is not None and current != (host, host_slot):
                    raise MappingConflict(
                        f"GPU {box}/{slot} is already mapped to host {current[0]!r} slot "
                        f"{current[1]}; unmap it there first"
                    )
                occupant = state.gpu_in(host, host_slot)
                if occupant is not None and occupant != (box, slot):
                    raise MappingConflict(
                        f"slot {host_slot} of host {host!r} already holds GPU "
                        f"{occupant[0]}/{occupant[1]}; pick a free slot or unmap it first"
                    )
                state.mappings[(box, slot)] = (host, host_slot)
                state.mapped_generation[(box, slot)] = generation
        _raise_injected(fault)

    def unmap(self, box: str, slot: int, host: str) -> None:
        """Unmap the GPU from ``host``.

        A no-op if the GPU is not mapped to ``host``: another host's mapping is never
        touched. If the GPU's device is still present on the host it disappears with the
        mapping (a surprise removal, as on real hardware).
        """
        self._sleep(self.delays.map_s)
        with self._transaction() as state:
            _require_gpu(state, box, slot)
            _require_host(state, host)
            fault = state.take_fault("unmap", box=box, slot=slot, host=host)
            current = state.mappings.get((box, slot))
            if fault is None and current is not None and current[0] == host:
                state.drop_mapping((box, slot))
        _raise_injected(fault)

    def revoke(self, box: str, slot: int) -> None:
        """Box-side fencing: drop the GPU's mapping whatever host holds it, and the device
        on that host. A no-op if the GPU is not mapped."""
        self._sleep(self.delays.map_s)
        with self._transaction() as state:
            _require_gpu(state, box, slot)
            state.drop_mapping((box, slot))

    def fence(self, box: str, slot: int, generation: int) -> bool:
        """Box-side fencing with a token: drop the GPU's mapping if it was made for
        ``generation`` or an older one (and its device on that host), and refuse maps for
        those generations from now on. A mapping made for a newer generation belongs to a
        newer assignment and is left alone. Idempotent. True if a mapping was dropped."""
        self._sleep(self.delays.map_s)
        with self._transaction() as state:
            _require_gpu(state, box, slot)
            fault = state.take_fault("fence", box=box, slot=slot)
            dropped = False
            if fault is None:
                key = (box, slot)
                state.fenced[key] = max(state.fenced.get(key, -1), generation)
                if key in state.mappings and state.mapped_generation.get(key, 0) <= generation:
                    state.drop_mapping(key)
                    dropped = True
        _raise_injected(fault)
        return dropped

    def fence_host(self, host: str) -> list[tuple[str, int]]:
        """Box-side fencing of a whole host: drop every mapping ``host`` holds (and their
        devices on it), and refuse maps for the generations those mappings were made for,
        so the host's agent cannot map them again. Other hosts' mappings are untouched.
        One transaction, so a GPU that moves to another host meanwhile is never cut off
        there. Idempotent. Returns the ``(box, slot)`` of every dropped mapping."""
        self._sleep(self.delays.map_s)
        with self._transaction() as state:
            _require_host(state, host)
            fault = state.take_fault("fence", host=host)
            dropped: list[tuple[str, int]] = []
            if fault is None:
                dropped = sorted(
                    key for key, (target, _) in state.mappings.items() if target == host
                )
                for key in dropped:
                    generation = state.mapped_generation.get(key, 0)
                    state.fenced[key] = max(state.fenced.get(key, -1), generation)
                    state.drop_mapping(key)
        _raise_injected(fault)
        return dropped

    def scrub(self, box: str, slot: int, generation: int) -> None:
        """Reset the GPU from the box side (its memory is cleared), for the assignment of
        ``generation``. Refused while the GPU is mapped: a mapped GPU may be in use."""
        self._sleep(self.delays.bind_s)
        with self._transaction() as state:
            _require_gpu(state, box, slot)
            fault = state.take_fault("scrub", box=box, slot=slot)
            if fault is None:
                current = state.mappings.get((box, slot))
                if current is not None:
                    raise MappingConflict(
                        f"GPU {box}/{slot} is mapped to host {current[0]!r}; fence it before "
                        "scrubbing"
                    )
                state.scrubbed[(box, slot)] = generation
        _raise_injected(fault)

    def fenced_generation(self, box: str, slot: int) -> int:
        """The highest generation fenced for the GPU (-1: never fenced)."""
        state = self._snapshot()
        _require_gpu(state, box, slot)
        return state.fenced.get((box, slot), -1)

    def scrubbed_generation(self, box: str, slot: int) -> int:
        """The generation of the GPU's last scrub (-1: never scrubbed)."""
        state = self._snapshot()
        _require_gpu(state, box, slot)
        return state.scrubbed.get((box, slot), -1)

    def mapping(self, box: str, slot: int) -> tuple[str, int] | None:
        """``(host, host_slot)`` the GPU is mapped to, or None."""
        state = self._snapshot()
        _require_gpu(state, box, slot)
        return state.mappings.get((box, slot))

    def mappings(self, host: str) -> dict[int, tuple[str, int]]:
        """The host-side table of ``host``: host slot -> ``(box, slot)``."""
        state = self._snapshot()
        _require_host(state, host)
        return {
            host_slot: gpu
            for gpu, (target, host_slot) in sorted(state.mappings.items())
            if target == host
        }

    # host PCIe bus ------------------------------------------------------------------------

    def rescan(self, host: str) -> None:
        """Rescan the host's PCIe bus: after ``hotplug_s``, every mapped slot without a
        device gets one, bound to "nvidia" as the native driver would. Idempotent; devices
        already present keep their driver."""
        self._sleep(self.delays.hotplug_s)
        with self._transaction() as state:
            _require_host(state, host)
            fault = state.take_fault("rescan", host=host)
            if fault is None:
                present = state.devices.setdefault(host, {})
                for (box, slot), (target, host_slot) in state.mappings.items():
                    if target == host and host_slot not in present:
                        present[host_slot] = DeviceRecord(box, slot, "nvidia")
        _raise_injected(fault)

    def remove_device(self, host: str, bdf: str) -> None:
        """Hot-remove a device from the host's bus (its mapping stays; a rescan brings it
        back). A no-op if no such device is present."""
        self._sleep(self.delays.hotplug_s)
        with self._transaction() as state:
            _require_host(state, host)
            host_slot = _device_slot(state, host, bdf)
            if host_slot is not None:
                del state.devices[host][host_slot]

    def devices(self, host: str) -> list[SimDevice]:
        """The devices present on the host's bus, in host slot order."""
        state = self._snapshot()
        _require_host(state, host)
        return [
            SimDevice(bdf_for(host_slot), record.box, record.slot, host_slot, record.driver)
            for host_slot, record in sorted(state.devices.get(host, {}).items())
        ]

    def bind(self, host: str, bdf: str, driver: str | None) -> None:
        """Bind the device to ``driver`` ("nvidia" or "vfio-pci"), or unbind it (None).
        Raises :class:`UnknownTarget` if the host has no such device."""
        if driver is not None and driver not in DRIVERS:
            raise SimFabricError(
                f"unknown driver {driver!r}: use {' or '.join(map(repr, DRIVERS))}, "
                "or None to unbind"
            )
        self._sleep(self.delays.bind_s)
        with self._transaction() as state:
            record = _require_device(state, host, bdf)
            fault = state.take_fault("bind", box=record.box, slot=record.slot, host=host)
            if fault is None:
                record.driver = driver
        _raise_injected(fault)

    def reset(self, host: str, bdf: str) -> None:
        """Reset the device from the host side (its memory is cleared); it must be
        unbound. Raises :class:`UnknownTarget` if the host has no such device."""
        self._sleep(self.delays.bind_s)
        with self._transaction() as state:
            record = _require_device(state, host, bdf)
            fault = state.take_fault("reset", box=record.box, slot=record.slot, host=host)
            bound = record.driver if fault is None else None
        _raise_injected(fault)
        if bound is not None:
            raise SimFabricError(f"device {bdf} is bound to {bound}; unbind it before a reset")

    def identity(self, host: str, bdf: str) -> SimIdentity:
        """What NVML reports for the device. NVML sees only devices bound to "nvidia": a
        device bound to vfio-pci (or unbound) raises :class:`SimFabricError`; no device
        raises :class:`UnknownTarget`."""
        with self._transaction() as state:
            record = _require_device(state, host, bdf)
            fault = state.take_fault("identity", box=record.box, slot=record.slot, host=host)
        _raise_injected(fault)
        if record.driver != "nvidia":
            bound = f"bound to {record.driver}" if record.driver else "not bound to a driver"
            raise SimFabricError(
                f"device {bdf} on host {host!r} is {bound}; NVML sees only devices bound to nvidia"
            )
        spec = state.boxes[record.box][record.slot]
        return SimIdentity(
            uuid=gpu_uuid(record.box, record.slot),
            serial=gpu_serial(record.box, record.slot),
            model=spec.model,
            memory_mib=spec.memory_mib,
            pci_id=spec.pci_id,
            healthy=(record.box, record.slot) not in state.unhealthy,
        )

    # faults and health --------------------------------------------------------------------

    def inject_fault(
        self,
        op: str,
        *,
        box: str | None = None,
        slot: int | None = None,
        host: str | None = None,
        count: int = 1,
        message: str = "injected fault",
    ) -> None:
        """Make the next ``count`` calls of ``op`` that match raise
        :class:`InjectedFault` (``message``). ``None`` matches anything; a rescan has no
        box or slot, so a rescan fault may only name a host. bind and identity match the
        box and slot of the device they address. A call that hits a fault does nothing
        else. Faults persist in the state and are seen by every process."""
        if op not in FAULT_OPS:
            raise SimFabricError(f"unknown fault op {op!r}: use one of {sorted(FAULT_OPS)}")
        if op == "rescan" and (box is not None or slot is not None):
            raise SimFabricError("a rescan fault can name a host only, not a box or slot")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise SimFabricError(f"fault count must be a positive integer, got {count!r}")
        with self._transaction() as state:
            if box is not None:
                _require_box(state, box)
                if slot is not None:
                    _require_gpu(state, box, slot)
            if host is not None:
                _require_host(state, host)
            state.faults.append(FaultRecord(op, box, slot, host, count, message))

    def clear_faults(self) -> None:
        """Drop every pending injected fault."""
        with self._transaction() as state:
            state.faults.clear()

    def set_health(self, box: str, slot: int, healthy: bool) -> None:
        """Set the health NVML reports for the GPU (it survives detach and re-attach)."""
        with self._transaction() as state:
            _require_gpu(state, box, slot)
            if healthy:
                state.unhealthy.discard((box, slot))
            else:
                state.unhealthy.add((box, slot))

    # state access -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[FabricState]:
        """Read-modify-write under the exclusive lock; written only if the block completes
        and changed something."""
        with self._file.locked():
            document = self._load()
            state = self._decode(document)
            yield state
            updated = state.to_json()
            if updated != document:
                self._file.store(updated)

    def _snapshot(self) -> FabricState:
        with self._file.locked(exclusive=False):
            return self._decode(self._load())

    def _load(self) -> object:
        try:
            return self._file.load()
        except FileNotFoundError:
            raise UnknownTarget(
                f"no simulated fabric in {self.state_dir}: create one with SimFabric.create()"
            ) from None
        except ValueError as error:
            raise SimFabricError(f"fabric state {self._file.path} is corrupt: {error}") from None

    def _decode(self, document: object) -> FabricState:
        try:
            return FabricState.from_json(document)
        except ValueError as error:
            raise SimFabricError(f"fabric state {self._file.path} is corrupt: {error}") from None

    @staticmethod
    def _sleep(seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


def _raise_injected(message: str | None) -> None:
    if message is not None:
        raise InjectedFault(message)


def _check_box_id(box: str) -> str:
    return _check_id(box, "box")


def _check_host_id(host: str) -> str:
    return _check_id(host, "host")


def _check_id(value: str, kind: str) -> str:
    try:
        return check_id(value, kind)
    except InvalidArgument as error:
        raise SimFabricError(error.message) from None


def _check_gpus(box: str, gpus: Sequence[SimGpuSpec]) -> list[SimGpuSpec]:
    specs = list(gpus)
    if not specs:
        raise SimFabricError(f"box {box!r} needs at least one GPU")
    for slot, spec in enumerate(specs):
        if not isinstance(spec, SimGpuSpec):
            raise SimFabricError(f"slot {slot} of box {box!r}: expected a SimGpuSpec, got {spec!r}")
    return specs


def _check_slot_count(host: str, slots: int) -> int:
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_HOST_SLOTS:
        raise SimFabricError(
            f"host {host!r}: proxy slot count must be an integer 1-{MAX_HOST_SLOTS}, got {slots!r}"
        )
    return slots


def _describe(gpus: Sequence[SimGpuSpec]) -> str:
    return ", ".join(f"{i}: {gpu.model} {gpu.memory_mib} MiB" for i, gpu in enumerate(gpus))


def _require_box(state: FabricState, box: str) -> list[SimGpuSpec]:
    gpus = state.boxes.get(box)
    if gpus is None:
        known = ", ".join(sorted(state.boxes)) or "none"
        raise UnknownTarget(f"unknown box {box!r} (installed boxes: {known})")
    return gpus


def _require_gpu(state: FabricState, box: str, slot: int) -> None:
    gpus = _require_box(state, box)
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < len(gpus):
        raise UnknownTarget(f"box {box!r} has no slot {slot!r}: its slots are 0-{len(gpus) - 1}")


def _require_host(state: FabricState, host: str) -> int:
    slots = state.hosts.get(host)
    if slots is None:
        known = ", ".join(sorted(state.hosts)) or "none"
        raise UnknownTarget(f"unknown host {host!r} (installed hosts: {known})")
    return slots


def _require_host_slot(state: FabricState, host: str, host_slot: int) -> None:
    slots = _require_host(state, host)
    valid = not isinstance(host_slot, bool) and isinstance(host_slot, int)
    if not valid or not 0 <= host_slot < slots:
        raise UnknownTarget(
            f"host {host!r} has no proxy slot {host_slot!r}: its slots are 0-{slots - 1}"
        )


def _device_slot(state: FabricState, host: str, bdf: str) -> int | None:
    wanted = bdf.strip().lower()
    for host_slot in state.devices.get(host, {}):
        if bdf_for(host_slot) == wanted:
            return host_slot
    return None


def _require_device(state: FabricState, host: str, bdf: str) -> DeviceRecord:
    _require_host(state, host)
    host_slot = _device_slot(state, host, bdf)
    if host_slot is None:
        present = ", ".join(bdf_for(s) for s in sorted(state.devices.get(host, {}))) or "none"
        raise UnknownTarget(f"host {host!r} has no PCI device {bdf!r} (present: {present})")
    return state.devices[host][host_slot]
