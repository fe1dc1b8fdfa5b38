"""InventoryService: GPU boxes, their GPUs, and hosts."""

from __future__ import annotations

import grpc

from dxpool.api.v1 import inventory_pb2 as inv
from dxpool.api.v1 import inventory_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.cache import Cache
from dxpool.broker.records import copy, timestamp
from dxpool.broker.rpc import handler, page
from dxpool.broker.store import Store, Txn
from dxpool.broker.validation import check_box, check_page_size, check_text
from dxpool.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from dxpool.names import (
    box_name,
    check_request_id,
    gpu_name,
    parse_box,
    parse_gpu,
    parse_host,
)
from dxpool.request import validate_gpu_request
from dxpool.store import keys as k

MAX_ATTEMPTS = 8


class InventoryService(inventory_pb2_grpc.InventoryServiceServicer):
    def __init__(self, store: Store, cache: Cache) -> None:
        self._store = store
        self._cache = cache

    # -- boxes -----------------------------------------------------------------------

    @handler("InventoryService.CreateBox")
    def CreateBox(self, request: inv.CreateBoxRequest, context: grpc.ServicerContext) -> pb.Box:
        check_request_id(request.request_id)
        box_id = request.box_id or (parse_box(request.box.name) if request.box.name else "")
        if not box_id:
            raise InvalidArgument("box_id is required, e.g. box1", reason="INVALID_NAME")
        gpus = _gpu_records(box_id, request)
        check_box(box_id, request.box, len(gpus))
        if request.request_id:
            existing = self._box_for_request(request.request_id)
            if existing is not None:
                return existing
        box = pb.Box(
            name=box_name(box_id),
            location=request.box.location,
            fabric_endpoint=request.box.fabric_endpoint,
            state=pb.BOX_STATE_ACTIVE,
            gpu_count=len(gpus),
            labels=request.box.labels,
            create_time=timestamp(),
        )
        keys = self._store.keys
        box_key = keys.box(box_id)
        txn = Txn().expect_absent(box_key).put(box_key, box)
        for gpu in gpus:
            gpu_key = keys.gpu(box_id, gpu.slot)
            txn.expect_absent(gpu_key).put(gpu_key, gpu)
        created = {box_key} | {keys.gpu(box_id, g.slot) for g in gpus}
        request_key = keys.request(request.request_id) if request.request_id else None
        if request_key:
            txn.expect_absent(request_key).put(request_key, box.name).read_on_failure(request_key)
            created.add(request_key)
        result = self._store.commit(txn)
        if result.succeeded:
            self._cache.apply_commit(result.revision, txn.writes, created=created)
            return box
        if request_key and result.current.get(request_key) is not None:
            existing = self._box_for_request(request.request_id)
            if existing is not None:
                return existing
        raise AlreadyExists(
            f"box {box.name} already exists (or has GPUs left over); pick another id, or "
            "delete it first with `dxpool box delete`",
            reason="BOX_EXISTS",
        )

    def _box_for_request(self, request_id: str) -> pb.Box | None:
        record = self._store.get(self._store.keys.request(request_id))
        if record is None:
            return None
        name = bytes(record.value).decode()
        if not name.startswith("boxes/"):
            raise AlreadyExists(
                f"request_id {request_id!r} was already used for {name}; use a new one",
                reason="REQUEST_ID_REUSED",
            )
        box = self._store.get(self._store.keys.box(parse_box(name)))
        return box.value if box else None

    @handler("InventoryService.GetBox")
    def GetBox(self, request: inv.GetBoxRequest, context: grpc.ServicerContext) -> pb.Box:
        box: pb.Box = self._box_record(request.name).value
        return box

    def _box_record(self, name: str):  # type: ignore[no-untyped-def]
        record = self._cache.get(k.BOXES, parse_box(name))
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
        items = [(name, r.value) for name, r in self._cache.items(k.BOXES)]
        boxes, token = page(items, check_page_size(request.page_size), request.page_token)
        return inv.ListBoxesResponse(boxes=boxes, next_page_token=token)

    @handler("InventoryService.CordonBox")
    def CordonBox(self, request: inv.CordonBoxRequest, context: grpc.ServicerContext) -> pb.Box:
        check_text(request.reason, "reason")
        return self._set_box_state(request.name, pb.BOX_STATE_CORDONED, request.reason)

    @handler("InventoryService.UncordonBox")
    def UncordonBox(self, request: inv.UncordonBoxRequest, context: grpc.ServicerContext) -> pb.Box:
        return self._set_box_state(request.name, pb.BOX_STATE_ACTIVE, "")

    def _set_box_state(self, name: str, state: pb.BoxState.ValueType, reason: str) -> pb.Box:
        for _ in range(MAX_ATTEMPTS):
            record = self._box_record(name)
            current: pb.Box = record.value
            if current.state == state and current.cordon_reason == reason:
                return current
            box = copy(current)
            box.state = state
            box.cordon_reason = reason
            key = self._store.keys.box(parse_box(name))
            txn = Txn().expect_revision(key, record.mod_revision).put(key, box)
            txn.read_on_failure(key)
            result = self._store.commit(txn)
            if result.succeeded:
                self._cache.apply_commit(result.revision, txn.writes)
                return box
            self._cache.apply_read(key, result.current.get(key), self._cache.revision)
        raise Aborted(f"updating {name} kept conflicting; retry", reason="COMMIT_CONFLICT")

    @handler("InventoryService.DeleteBox")
    def DeleteBox(
        self, request: inv.DeleteBoxRequest, context: grpc.ServicerContext
    ) -> inv.DeleteBoxResponse:
        box_id = parse_box(request.name)
        for _ in range(MAX_ATTEMPTS):
            record = self._box_record(request.name)
            keys = self._store.keys
            txn = Txn().expect_revision(keys.box(box_id), record.mod_revision)
            txn.delete(keys.box(box_id)).read_on_failure(keys.box(box_id))
            owned = []
            for name, gpu_record in self._cache.items(k.GPUS):
                if not name.startswith(box_id + "/"):
                    continue
                gpu: pb.Gpu = gpu_record.value
                if gpu.node or gpu.state not in (pb.GPU_STATE_FREE, pb.GPU_STATE_FAULTED):
                    owned.append(f"{gpu.name} ({gpu.node or pb.GpuState.Name(gpu.state)})")
                key = keys.gpu(box_id, gpu.slot)
                txn.expect_revision(key, gpu_record.mod_revision).delete(key)
                txn.read_on_failure(key)
            if owned:
                raise FailedPrecondition(
                    f"box {request.name} still has GPUs in use: {', '.join(owned[:8])}; "
                    "cordon it, release those nodes, then delete",
                    reason="BOX_IN_USE",
                )
            result = self._store.commit(txn)
            if result.succeeded:
                self._cache.apply_commit(result.revision, txn.writes)
                return inv.DeleteBoxResponse()
            for key, value in result.current.items():
                self._cache.apply_read(key, value, self._cache.revision)
        raise Aborted(f"deleting {request.name} kept conflicting; retry", reason="COMMIT_CONFLICT")

    # -- GPUs ------------------------------------------------------------------------

    @handler("InventoryService.GetGpu")
    def GetGpu(self, request: inv.GetGpuRequest, context: grpc.ServicerContext) -> pb.Gpu:
        ref = parse_gpu(request.name)
        record = self._cache.get(k.GPUS, f"{ref.box}/{ref.slot}")
        if record is None:
            raise NotFound(
                f"GPU {request.name} does not exist; list GPUs with `dxpool gpu list`",
                reason="GPU_NOT_FOUND",
            )
        gpu: pb.Gpu = record.value
        return gpu

    @handler("InventoryService.ListGpus")
    def ListGpus(
        self, request: inv.ListGpusRequest, context: grpc.ServicerContext
    ) -> inv.ListGpusResponse:
        box_filter = parse_box(request.parent) if request.parent else None
        if box_filter is not None and self._cache.get(k.BOXES, box_filter) is None:
            raise NotFound(f"box {request.parent} does not exist", reason="BOX_NOT_FOUND")
        model = request.model.lower()
        items = []
        for _name, record in self._cache.items(k.GPUS):
            gpu: pb.Gpu = record.value
            if box_filter is not None and gpu.box != f"boxes/{box_filter}":
                continue
            if request.state and gpu.state != request.state:
                continue
            if model and gpu.model.lower() != model:
                continue
            items.append((f"{gpu.box}/{gpu.slot:05d}", gpu))
        items.sort(key=lambda item: item[0])
        gpus, token = page(items, check_page_size(request.page_size), request.page_token)
        return inv.ListGpusResponse(gpus=gpus, next_page_token=token)

    # -- hosts -----------------------------------------------------------------------

    @handler("InventoryService.GetHost")
    def GetHost(self, request: inv.GetHostRequest, context: grpc.ServicerContext) -> pb.Host:
        host_id = parse_host(request.name)
        record = self._cache.get(k.HOSTS, host_id)
        if record is None:
            raise NotFound(
                f"host {request.name} is not registered; its host agent registers it "
                "when it starts",
                reason="HOST_NOT_FOUND",
            )
        return self._host_view(host_id, record.value)

    @handler("InventoryService.ListHosts")
    def ListHosts(
        self, request: inv.ListHostsRequest, context: grpc.ServicerContext
    ) -> inv.ListHostsResponse:
        items = [(name, self._host_view(name, r.value)) for name, r in self._cache.items(k.HOSTS)]
        hosts, token = page(items, check_page_size(request.page_size), request.page_token)
        return inv.ListHostsResponse(hosts=hosts, next_page_token=token)

    def _host_view(self, host_id: str, host: pb.Host) -> pb.Host:
        view = copy(host)
        view.alive = self._cache.get(k.HOST_LEASES, host_id) is not None
        allocation = self._cache.get(k.HOST_ALLOCATIONS, host_id)
        view.slots_used = len(allocation.value.attachments) if allocation else 0
        return view


def _gpu_records(box_id: str, request: inv.CreateBoxRequest) -> list[pb.Gpu]:
    """The GPUs a CreateBox request describes, validated."""
    if request.gpus:
        slots = [s.slot for s in request.gpus]
        if len(set(slots)) != len(slots):
            raise InvalidArgument("gpus lists a slot twice; give each slot once")
        specs = list(request.gpus)
    else:
        count = request.box.gpu_count
        if count <= 0:
            raise InvalidArgument(
                f"box.gpu_count must be 1 or more (got {count}), or list the slots in gpus",
                reason="INVALID_GPU_COUNT",
            )
        if count > 64:
            raise InvalidArgument(
                f"a box holds 1 to 64 GPUs; got box.gpu_count {count}", reason="INVALID_GPU_COUNT"
            )
        specs = [
            inv.GpuSlotSpec(slot=slot, model=request.gpu_model, memory_mib=request.gpu_memory_mib)
            for slot in range(count)
        ]
    gpus = []
    for spec in specs:
        if not spec.model:
            raise InvalidArgument(
                f"GPU model is required for slot {spec.slot} (e.g. gpu_model: H100)",
                reason="INVALID_GPU_MODEL",
            )
        validate_gpu_request(spec.model, 1)
        if not 0 <= spec.slot < 64:
            raise InvalidArgument(f"GPU slot {spec.slot} is out of range 0-63")
        if spec.memory_mib < 0:
            raise InvalidArgument(f"GPU memory for slot {spec.slot} must be 0 or more MiB")
        check_text(spec.pci_id, "pci_id", 16)
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
