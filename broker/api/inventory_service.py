"""InventoryService: GPU boxes, their GPUs, and hosts."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from dxpool import lifecycle
from dxpool.api.v1 import inventory_pb2 as inv
from dxpool.api.v1 import inventory_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.rpc import handler
from dxpool.broker.api.sharing_status import SharingStatus
from dxpool.broker.control.maintenance import Maintenance
from dxpool.broker.nodes.validation import (
    check_box,
    check_enum,
    check_page_size,
    check_pci_id,
    check_text,
)
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.pages import cache_page, check_page_token
from dxpool.broker.state.pool_tally import PoolTally
from dxpool.broker.state.records import copy, timestamp
from dxpool.broker.state.stm import RecordReader, TxnView, transact
from dxpool.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from dxpool.limits import MAX_GPUS_PER_BOX
from dxpool.names import (
    box_name,
    check_id,
    check_request_id,
    gpu_name,
    parse_box,
    parse_gpu,
    parse_host,
)
from dxpool.request import check_gpu_memory_mib, check_model
from dxpool.selector import parse_selector
from dxpool.store import keys as k
from dxpool.store.typed import Store, Versioned


class InventoryService(inventory_pb2_grpc.InventoryServiceServicer):
    """``maintenance`` serves host cordons and drains and box drains; ``sharing`` adds the
    queue and preemptions to the pool status. Without them those calls answer
    FAILED_PRECONDITION and the status leaves them out."""

    def __init__(
        self,
        store: Store,
        cache: Cache,
        tally: PoolTally,
        *,
        maintenance: Maintenance | None = None,
        sharing: SharingStatus | None = None,
    ) -> None:
        self._store = store
        self._cache = cache
        self._tally = tally
        self._maintenance = maintenance
        self._sharing = sharing

    # -- boxes -----------------------------------------------------------------------

    @handler("InventoryService.CreateBox")
    def CreateBox(self, request: inv.CreateBoxRequest, context: grpc.ServicerContext) -> pb.Box:
        check_request_id(request.request_id)
        box_id = _box_id(request)
        gpus = _gpu_records(box_id, request)
        check_box(box_id, request.box, len(gpus))
        _spell_models_as_the_pool_does(gpus, (model for model, _ in self._tally.gpu_states()))
        box = pb.Box(
            name=box_name(box_id),
            location=request.box.location,
            fabric_endpoint=request.box.fabric_endpoint,
            state=pb.BOX_STATE_ACTIVE,
            gpu_count=len(gpus),
            labels=request.box.labels,
            create_time=timestamp(),
            request_id=request.request_id,
        )
        return self._box_view(self._create_box(box_id, box, gpus))

    def _create_box(self, box_id: str, box: pb.Box, gpus: list[pb.Gpu]) -> pb.Box:
        """Commit ``box``, its GPUs and its request key in one transaction.

        With a request_id, an earlier call that used it decides first: the same request
        gets the box it made, another request ALREADY_EXISTS (REQUEST_ID_REUSED). A
        request key left behind by a box that no longer holds it (written before
        DeleteBox removed request keys) is taken over, compared on its revision.
        """
        tries = 0

        def create(view: TxnView) -> pb.Box:
            nonlocal tries
            tries += 1
            if box.request_id:
                earlier = self._earlier_create(box_id, box, gpus)
                if isinstance(earlier, pb.Box):
                    return earlier
                view.require(k.REQUESTS, box.request_id, earlier)
                view.put(k.REQUESTS, box.request_id, box.name)
            _number_generations_from(self._store.current_revision(), gpus)
            # Required absent whatever the cache holds; once a compare failed, the cache
            # holds what etcd returned for these keys and says whether they exist.
            names = [(k.BOXES, box_id)] + [(k.GPUS, f"{box_id}/{gpu.slot}") for gpu in gpus]
            if tries > 1 and any(self._cache.get(*name) is not None for name in names):
                raise AlreadyExists(
                    f"box {box.name} already exists (or has GPUs left over); pick another "
                    "id, or delete it first with `dxpool box delete`",
                    reason="BOX_EXISTS",
                )
            for collection, name in names:
                view.require(collection, name, 0)
            view.put(k.BOXES, box_id, box)
            for gpu in gpus:
                view.put(k.GPUS, f"{box_id}/{gpu.slot}", gpu)
            return box

        # A lost compare brings back the box, its GPUs and the request key as etcd holds
        # them: the next attempt answers BOX_EXISTS, or (a concurrent call took the
        # request id first) looks at what that call made.
        return transact(
            self._store, self._cache, create, what=f"creating {box.name}", operation="box"
        )

    def _earlier_create(self, box_id: str, box: pb.Box, gpus: list[pb.Gpu]) -> pb.Box | int:
        """What an earlier call with ``box.request_id`` left: the box to return for a
        retry, or the revision of the request key to compare on (0: absent, else a
        stale key to take over). Raises REQUEST_ID_REUSED for another request's id.
        """
        keys = self._store.keys
        request_key = keys.request(box.request_id)
        # One snapshot: the request key, the box, and its GPUs at the same revision.
        gpu_prefix = keys.box_gpus(box_id)
        found = self._store.read([request_key, keys.box(box_id)], [gpu_prefix])
        record = found.get(request_key)
        if record is None:
            return 0
        owner = bytes(record.value).decode(errors="replace")
        if owner == box.name:
            existing = found.get(keys.box(box_id))
            if existing is not None and existing.value.request_id == box.request_id:
                stored_gpus = [r.value for key, r in found.items() if key.startswith(gpu_prefix)]
                if _same_box(existing.value, stored_gpus, box, gpus):
                    stored: pb.Box = existing.value
                    return stored
                raise _request_id_reused(box.request_id, owner)
            # No box holds the id any more (deleted before DeleteBox removed request keys,
            # and maybe registered again without it): a stale key, to take over.
            return record.mod_revision
        if owner.startswith("boxes/"):
            other = self._store.get(keys.box(owner.removeprefix("boxes/")))
            if other is None or other.value.request_id != box.request_id:
                return record.mod_revision
        raise _request_id_reused(box.request_id, owner)

    @handler("InventoryService.GetBox")
    def GetBox(self, request: inv.GetBoxRequest, context: grpc.ServicerContext) -> pb.Box:
        return self._box_view(self._box_record(request.name).value)

    def _box_view(self, box: pb.Box) -> pb.Box:
        """``box`` as the API answers it: ``gpus_free`` filled in from the cache, on a
        copy (cache records are shared, and the stored record never holds it).
        O(log n + the box's GPUs)."""
        box_id = parse_box(box.name)
        view = copy(box)
        chunk, _ = self._cache.gpus.scan(f"{box_id}/", MAX_GPUS_PER_BOX)
        if box.state == pb.BOX_STATE_ACTIVE:
            view.gpus_free = sum(
                1
                for name, record in chunk
                if name.startswith(f"{box_id}/") and lifecycle.is_free(record.value)
            )
        if self._maintenance is not None:
            self._maintenance.describe_box(view)
        return view

    def _box_record(
        self, name: str, boxes: RecordReader[pb.Box] | None = None
    ) -> Versioned[pb.Box]:
        """Box ``name``'s record, read through ``boxes`` (a TxnView's, which has the
        commit compare it) or from the cache; NOT_FOUND (BOX_NOT_FOUND) if absent."""
        record = (boxes or self._cache.boxes).get(parse_box(name))
        if record is None:
            raise NotFound(
                f"box {name} does not exist; list boxes with `dxpool box list`",
                reason="BOX_NOT_FOUND",
            )
        return record

    @handler("InventoryService.ListBoxes")
    def ListBoxes(
        self, request: inv.ListBoxesRequest, context: grpc.ServicerContext
    ) -> inv.ListBoxesResponse:
        selector = parse_selector(request.label_selector)
        chunk, token = cache_page(
            self._cache.boxes,
            check_page_size(request.page_size),
            request.page_token,
            lambda record: selector.matches(record.value.labels),
        )
        boxes = [self._box_view(r.value) for _, r in chunk]
        return inv.ListBoxesResponse(boxes=boxes, next_page_token=token)

    @handler("InventoryService.CordonBox")
    def CordonBox(self, request: inv.CordonBoxRequest, context: grpc.ServicerContext) -> pb.Box:
        check_text(request.reason, "reason")
        return self._box_view(
            self._set_box_state(request.name, pb.BOX_STATE_CORDONED, request.reason)
        )

    @handler("InventoryService.UncordonBox")
    def UncordonBox(self, request: inv.UncordonBoxRequest, context: grpc.ServicerContext) -> pb.Box:
        return self._box_view(self._set_box_state(request.name, pb.BOX_STATE_ACTIVE, ""))

    def _set_box_state(self, name: str, state: pb.BoxState.ValueType, reason: str) -> pb.Box:
        box_id = parse_box(name)

        def change(view: TxnView) -> pb.Box:
            current = self._box_record(name, view.boxes).value
            if (
                current.state == state
                and current.cordon_reason == reason
                and (state != pb.BOX_STATE_ACTIVE or not current.HasField("drain"))
            ):
                return current
            box = copy(current)
            box.state = state
            box.cordon_reason = reason
            if state == pb.BOX_STATE_ACTIVE:
                box.ClearField("drain")  # uncordoning ends a drain
            view.put(k.BOXES, box_id, box)
            return box

        return transact(self._store, self._cache, change, what=f"updating {name}", operation="box")

    @handler("InventoryService.DeleteBox")
    def DeleteBox(
        self, request: inv.DeleteBoxRequest, context: grpc.ServicerContext
    ) -> inv.DeleteBoxResponse:
        box_id = parse_box(request.name)

        def delete(view: TxnView) -> None:
            box = self._box_record(request.name, view.boxes).value
            view.delete(k.BOXES, box_id)
            if box.request_id:
                # The request key names this box: CreateBox wrote both in one transaction,
                # and nothing else replaces a request key whose box still holds it. It goes
                # with the box, so the same request can register the box again.
                view.delete(k.REQUESTS, box.request_id)
            owned = []
            for name, _ in self._cache.gpus.items():
                if not name.startswith(box_id + "/"):
                    continue
                gpu_record = view.gpus.get(name)
                assert gpu_record is not None  # listed by the cache a moment ago
                gpu = gpu_record.value
                if gpu.node or gpu.state not in (pb.GPU_STATE_FREE, pb.GPU_STATE_FAULTED):
                    owned.append(f"{gpu.name} ({gpu.node or pb.GpuState.Name(gpu.state)})")
                view.delete(k.GPUS, name)
            if owned:
                raise FailedPrecondition(
                    f"box {request.name} still has GPUs in use: {', '.join(owned[:8])}; "
                    "cordon it, release those nodes, then delete",
                    reason="BOX_IN_USE",
                )

        transact(self._store, self._cache, delete, what=f"deleting {request.name}", operation="box")
        return inv.DeleteBoxResponse()

    # -- GPUs ------------------------------------------------------------------------

    @handler("InventoryService.GetGpu")
    def GetGpu(self, request: inv.GetGpuRequest, context: grpc.ServicerContext) -> pb.Gpu:
        ref = parse_gpu(request.name)
        return _existing_gpu(self._cache.gpus, f"{ref.box}/{ref.slot}", request.name)

    @handler("InventoryService.ReclaimGpu")
    def ReclaimGpu(self, request: inv.ReclaimGpuRequest, context: grpc.ServicerContext) -> pb.Gpu:
        ref = parse_gpu(request.name)
        reason = check_text(request.reason, "reason")
        gpu_key = f"{ref.box}/{ref.slot}"
        message = "reclaimed by an operator" + (f": {reason}" if reason else "")

        def body(view: TxnView) -> pb.Gpu:
            gpu = _existing_gpu(view.gpus, gpu_key, request.name)
            if gpu.state == pb.GPU_STATE_FENCING:
                return gpu
            if gpu.state != pb.GPU_STATE_QUARANTINED:
                state = pb.GpuState.Name(gpu.state).removeprefix("GPU_STATE_")
                raise FailedPrecondition(
                    f"GPU {request.name} is {state}, not QUARANTINED: only quarantined GPUs "
                    "are reclaimed; see `dxpool gpu list --state quarantined`",
                    reason="GPU_NOT_QUARANTINED",
                )
            updated = lifecycle.begin_fence(gpu, message)
            view.put(k.GPUS, gpu_key, updated)
            return updated

        return transact(self._store, self._cache, body, what=f"reclaiming {request.name}")

    @handler("InventoryService.ClearGpuHealth")
    def ClearGpuHealth(
        self, request: inv.ClearGpuHealthRequest, context: grpc.ServicerContext
    ) -> pb.Gpu:
        ref = parse_gpu(request.name)
        reason = check_text(request.reason, "reason")
        gpu_key = f"{ref.box}/{ref.slot}"
        message = "health cleared by an operator" + (f": {reason}" if reason else "")

        def body(view: TxnView) -> pb.Gpu:
            gpu = _existing_gpu(view.gpus, gpu_key, request.name)
            if gpu.health == pb.GPU_HEALTH_HEALTHY:
                return gpu
            if gpu.host:
                # Read even when absent: an agent report landing meanwhile fails the commit.
                status = view.host_statuses.get(parse_host(gpu.host))
                seen = next(
                    (a for a in (status.value.attachments if status else ()) if a.gpu == gpu.name),
                    None,
                )
                if (
                    seen is not None
                    and seen.generation == gpu.generation
                    and seen.health == pb.GPU_HEALTH_UNHEALTHY
                ):
                    node = gpu.node.removeprefix("nodes/") or "NODE"
                    raise FailedPrecondition(
                        f"GPU {request.name} is still reported unhealthy by the agent of "
                        f"{gpu.host}: {seen.health_reason or 'no reason given'}; release its "
                        f"node (`dxpool node delete {node}`) or fix the GPU, then clear it",
                        reason="GPU_STILL_UNHEALTHY",
                    )
            updated = lifecycle.health_cleared(gpu, message)
            view.put(k.GPUS, gpu_key, updated)
            return updated

        return transact(self._store, self._cache, body, what=f"clearing {request.name}")

    @handler("InventoryService.ListGpus")
    def ListGpus(
        self, request: inv.ListGpusRequest, context: grpc.ServicerContext
    ) -> inv.ListGpusResponse:
        box_filter = parse_box(request.parent) if request.parent else None
        if request.state:
            check_enum(request.state, pb.GpuState.DESCRIPTOR, "state")
        check_model(request.model)
        page_size = check_page_size(request.page_size)
        check_page_token(request.page_token)
        if box_filter is not None and self._cache.boxes.get(box_filter) is None:
            raise NotFound(
                f"box {request.parent} does not exist; list boxes with `dxpool box list`",
                reason="BOX_NOT_FOUND",
            )
        model = request.model.lower()
        box_name = f"boxes/{box_filter}" if box_filter is not None else ""

        def keep(record: Versioned[pb.Gpu]) -> bool:
            gpu = record.value
            return (
                (not box_name or gpu.box == box_name)
                and (not request.state or gpu.state == request.state)
                and (not model or gpu.model.lower() == model)
            )

        chunk, token = cache_page(self._cache.gpus, page_size, request.page_token, keep)
        gpus = [r.value for _, r in chunk]
        return inv.ListGpusResponse(gpus=gpus, next_page_token=token)

    # -- hosts -----------------------------------------------------------------------

    @handler("InventoryService.GetHost")
    def GetHost(self, request: inv.GetHostRequest, context: grpc.ServicerContext) -> pb.Host:
        host_id = parse_host(request.name)
        record = self._cache.hosts.get(host_id)
        if record is None:
            raise NotFound(
                f"host {request.name} is not registered; its host agent registers it "
                "when it starts",
                reason="HOST_NOT_FOUND",
            )
        return self._host_view(host_id, record.value)

    @handler("InventoryService.GetPoolStatus")
    def GetPoolStatus(
        self, request: inv.GetPoolStatusRequest, context: grpc.ServicerContext
    ) -> inv.PoolStatus:
        status = self._tally.status()
        if self._sharing is not None:
            self._sharing.fill(status)
        return status

    @handler("InventoryService.ListHosts")
    def ListHosts(
        self, request: inv.ListHostsRequest, context: grpc.ServicerContext
    ) -> inv.ListHostsResponse:
        selector = parse_selector(request.label_selector)
        chunk, token = cache_page(
            self._cache.hosts,
            check_page_size(request.page_size),
            request.page_token,
            lambda record: selector.matches(record.value.labels),
        )
        hosts = [self._host_view(name, r.value) for name, r in chunk]
        return inv.ListHostsResponse(hosts=hosts, next_page_token=token)

    def _host_view(self, host_id: str, host: pb.Host) -> pb.Host:
        view = copy(host)
        view.alive = self._cache.host_leases.get(host_id) is not None
        allocation = self._cache.host_allocations.get(host_id)
        used = sorted({a.host_slot for a in allocation.value.attachments} if allocation else ())
        view.slots_used = len(allocation.value.attachments) if allocation else 0
        view.used_slots.extend(used)
        if self._maintenance is not None:
            self._maintenance.describe_host(view, allocation.value if allocation else None)
        return view

    # -- maintenance -------------------------------------------------------------------

    def _needs_maintenance(self) -> Maintenance:
        if self._maintenance is None:
            raise FailedPrecondition(
                "this broker does not serve host maintenance", reason="NOT_SERVED"
            )
        return self._maintenance

    def _host_answer(self, host_id: str) -> pb.Host:
        record = self._cache.hosts.get(host_id)
        if record is None:
            raise NotFound(f"host hosts/{host_id} is not registered", reason="HOST_NOT_FOUND")
        return self._host_view(host_id, record.value)

    @handler("InventoryService.CordonHost")
    def CordonHost(self, request: inv.CordonHostRequest, context: grpc.ServicerContext) -> pb.Host:
        host_id = self._needs_maintenance().cordon_host(request.name, request.reason)
        return self._host_answer(host_id)

    @handler("InventoryService.UncordonHost")
    def UncordonHost(
        self, request: inv.UncordonHostRequest, context: grpc.ServicerContext
    ) -> pb.Host:
        host_id = self._needs_maintenance().uncordon_host(request.name)
        return self._host_answer(host_id)

    @handler("InventoryService.DrainHost")
    def DrainHost(self, request: inv.DrainHostRequest, context: grpc.ServicerContext) -> pb.Host:
        host_id = self._needs_maintenance().drain_host(request.name, request.reason, request.policy)
        return self._host_answer(host_id)

    @handler("InventoryService.DrainBox")
    def DrainBox(self, request: inv.DrainBoxRequest, context: grpc.ServicerContext) -> pb.Box:
        box = self._needs_maintenance().drain_box(request.name, request.reason, request.policy)
        return self._box_view(box)


def _box_id(request: inv.CreateBoxRequest) -> str:
    """The id of the box to create: ``box_id``, or the id in ``box.name``; not both apart."""
    named = parse_box(request.box.name) if request.box.name else ""
    if request.box_id and named and named != request.box_id:
        raise InvalidArgument(
            f"box_id {request.box_id!r} and box.name {request.box.name!r} name different "
            "boxes; give one of them",
            reason="INVALID_NAME",
        )
    box_id = request.box_id or named
    if not box_id:
        raise InvalidArgument(
            "box_id is required: set box_id (e.g. box1) or box.name (boxes/box1)",
            reason="INVALID_NAME",
        )
    return check_id(box_id, "box")


def _gpu_records(box_id: str, request: inv.CreateBoxRequest) -> list[pb.Gpu]:
    """The GPUs a CreateBox request describes, validated."""
    if request.gpus:
        if len(request.gpus) > MAX_GPUS_PER_BOX:
            raise InvalidArgument(
                f"gpus lists {len(request.gpus)} slots; a box holds 1 to {MAX_GPUS_PER_BOX}: "
                f"list at most {MAX_GPUS_PER_BOX}",
                reason="INVALID_GPU_COUNT",
            )
        slots = [s.slot for s in request.gpus]
        if len(set(slots)) != len(slots):
            raise InvalidArgument(
                "gpus lists a slot twice; give each slot once", reason="DUPLICATE_SLOT"
            )
        specs = list(request.gpus)
    else:
        count = request.box.gpu_count
        if not 1 <= count <= MAX_GPUS_PER_BOX:
            raise InvalidArgument(
                f"a box holds 1 to {MAX_GPUS_PER_BOX} GPUs; got box.gpu_count {count} "
                "(set box.gpu_count, or list the slots in gpus)",
                reason="INVALID_GPU_COUNT",
            )
        specs = [
            inv.GpuSlotSpec(slot=slot, model=request.gpu_model, memory_mib=request.gpu_memory_mib)
            for slot in range(count)
        ]
    gpus = []
    for spec in specs:
        if not 0 <= spec.slot < MAX_GPUS_PER_BOX:
            raise InvalidArgument(
                f"GPU slot {spec.slot} is out of range: use 0-{MAX_GPUS_PER_BOX - 1}",
                reason="INVALID_SLOT",
            )
        if not spec.model:
            raise InvalidArgument(
                f"GPU model is required for slot {spec.slot}: set gpu_model (e.g. H100), or "
                "the model of each slot in gpus",
                reason="INVALID_GPU_MODEL",
            )
        check_model(spec.model)
        field = "gpu_memory_mib" if not request.gpus else f"memory_mib of slot {spec.slot}"
        check_gpu_memory_mib(spec.memory_mib, field)
        check_pci_id(spec.pci_id, f"pci_id of slot {spec.slot}")
        gpus.append(
            pb.Gpu(
                name=gpu_name(box_id, spec.slot),
                box=box_name(box_id),
                slot=spec.slot,
                model=spec.model,
                memory_mib=spec.memory_mib,
                pci_id=spec.pci_id,
                health=pb.GPU_HEALTH_HEALTHY,
                state=pb.GPU_STATE_FREE,
            )
        )
    return gpus


def _spell_models_as_the_pool_does(gpus: list[pb.Gpu], known: Iterable[str]) -> None:
    """Give each GPU the spelling of its model that the pool already uses (``h100`` ->
    ``H100``): models compare case-insensitively everywhere, so two spellings of one
    model would only show up as two rows of one model in every listing."""
    spelled = {model.casefold(): model for model in known}
    for gpu in gpus:
        gpu.model = spelled.get(gpu.model.casefold(), gpu.model)


def _number_generations_from(revision: int, gpus: list[pb.Gpu]) -> None:
    """Start every GPU's generation at ``revision``, etcd's revision before the commit
    that registers them.

    A generation is the fencing token the box side keeps per slot, and it must never
    repeat for the same slot, also when its box is deleted and added again (the
    documented step after a GPU is replaced): the box side still refuses every
    generation up to the last one it fenced. A generation only grows in a commit that
    writes its GPU, and every commit raises the revision by one, so no generation the
    slot held before can exceed the revision read now, and the first assignment of the
    registered GPU (``revision + 1``) is newer than any fence the slot has seen.
    """
    for gpu in gpus:
        gpu.generation = revision


def _same_box(stored: pb.Box, stored_gpus: list[pb.Gpu], box: pb.Box, gpus: list[pb.Gpu]) -> bool:
    """True if a request for ``box`` and ``gpus`` would register what is stored.

    Only what the request sets is compared: the state, cordon reason and create time of
    the box, and the scheduling state of its GPUs, change after it is created.
    """
    if (
        stored.name != box.name
        or stored.location != box.location
        or stored.fabric_endpoint != box.fabric_endpoint
        or stored.gpu_count != box.gpu_count
        or dict(stored.labels) != dict(box.labels)
    ):
        return False
    by_slot = {gpu.slot: gpu for gpu in stored_gpus}
    return len(by_slot) == len(gpus) and all(
        (other := by_slot.get(gpu.slot)) is not None
        and (other.model, other.memory_mib, other.pci_id) == (gpu.model, gpu.memory_mib, gpu.pci_id)
        for gpu in gpus
    )


def _request_id_reused(request_id: str, owner: str) -> AlreadyExists:
    return AlreadyExists(
        f"request_id {request_id!r} was already used for {owner} by a different request; "
        f"use a new request_id (repeat the original request unchanged to get {owner} back)",
        reason="REQUEST_ID_REUSED",
        metadata={"request_id": request_id, "resource": owner},
    )


def _existing_gpu(gpus: RecordReader[pb.Gpu], gpu_key: str, name: str) -> pb.Gpu:
    """The GPU ``gpu_key`` (``box/slot``) as ``gpus`` holds it; NOT_FOUND (GPU_NOT_FOUND)
    naming ``name`` as the caller wrote it when there is none."""
    record = gpus.get(gpu_key)
    if record is None:
        raise NotFound(
            f"GPU {name} does not exist; list GPUs with `dxpool gpu list`",
            reason="GPU_NOT_FOUND",
        )
    return record.value
