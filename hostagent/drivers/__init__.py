"""Fabric driver registry: the one place drivers are listed.

``build_driver(config)`` returns the :class:`~dxpool.hostagent.driver.FabricDriver` that
``config.driver`` names. ``"sim"`` runs on the simulated fabric in ``config.sim_state_dir``;
``"linux"`` on the host's real PCIe bus (sysfs under ``config.sysfs_root``), its proxy
programmed by ``config.proxy_hook`` and its GPUs read by NVML.

``build_proxy_mapper(config)`` returns the box-side
:class:`~dxpool.hostagent.driver.ProxyMapper` the config selects in place of a driver's
own (today: Redfish, with ``config.redfish_map``), or None. The Linux driver uses it in
place of the proxy hook; the simulated fabric maps on itself only, so the sim driver
refuses a selected mapper.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dxpool.errors import FailedPrecondition, InvalidArgument
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.driver import FabricDriver, ProxyMapper
from dxpool.hostagent.errors import DriverError

log = logging.getLogger(__name__)


def _build_sim(config: AgentConfig) -> FabricDriver:
    from dxpool.fabric.sim import SimDelays, SimFabric, SimFabricError, UnknownTarget
    from dxpool.hostagent.drivers.sim import make_sim_driver

    if config.redfish_map is not None:
        raise InvalidArgument(
            "the sim driver maps GPUs on the simulated fabric; --redfish-map is for a driver "
            "of real hosts"
        )
    if config.sim_state_dir is None:
        raise InvalidArgument(
            "the sim driver needs sim_state_dir (--sim-state-dir): the directory of a "
            "simulated fabric"
        )
    delays = SimDelays(
        map_s=config.sim_map_delay_s,
        hotplug_s=config.sim_hotplug_delay_s,
        bind_s=config.sim_bind_delay_s,
    )
    try:
        fabric = SimFabric(config.sim_state_dir, delays)
        hosts = fabric.hosts()
        if config.host_id not in hosts:
            # A simulated host's proxy card is "installed" when its agent first starts.
            fabric.add_host(config.host_id, config.slot_capacity)
            log.info(
                "host added to simulated fabric",
                extra={"host": config.host_id, "slots": config.slot_capacity},
            )
        elif hosts[config.host_id] != config.slot_capacity:
            raise InvalidArgument(
                f"slot_capacity {config.slot_capacity} does not match the "
                f"{hosts[config.host_id]} proxy slots host {config.host_id!r} has in the "
                f"simulated fabric at {config.sim_state_dir}; pass --slot-capacity "
                f"{hosts[config.host_id]}"
            )
    except UnknownTarget as error:
        raise FailedPrecondition(
            f"no simulated fabric at {config.sim_state_dir} ({error}); create one first"
        ) from error
    except SimFabricError as error:
        raise FailedPrecondition(f"simulated fabric at {config.sim_state_dir}: {error}") from error
    return make_sim_driver(fabric, config.host_id, device_timeout_s=config.device_timeout_s)


def _build_linux(config: AgentConfig) -> FabricDriver:
    from dxpool.hostagent.drivers.linux import make_linux_driver
    from dxpool.hostagent.drivers.sysfs import Sysfs

    if not config.linux_ports:
        raise InvalidArgument(
            "the linux driver needs the bridge of every host slot (--linux-port SLOT=BRIDGE, "
            "e.g. --linux-port 0=0000:40:01.0)"
        )
    if (config.proxy_hook is None) == (config.redfish_map is None):
        raise InvalidArgument(
            "the linux driver needs exactly one way to map GPUs: a proxy hook "
            "(--proxy-hook PATH) or a Redfish fabric map (--redfish-map FILE)"
        )
    return make_linux_driver(
        host_id=config.host_id,
        ports=config.linux_ports,
        proxy_hook=config.proxy_hook,
        mapper=build_proxy_mapper(config),
        sysfs=Sysfs(config.sysfs_root),
        hook_timeout_s=config.proxy_hook_timeout_s,
        device_timeout_s=config.device_timeout_s,
        p2p=config.fabric_p2p,
    )


DRIVERS: dict[str, Callable[[AgentConfig], FabricDriver]] = {
    "linux": _build_linux,
    "sim": _build_sim,
}


def build_proxy_mapper(config: AgentConfig) -> ProxyMapper | None:
    """The box-side mapper ``config`` selects, connected and checked against its service,
    or None when the driver's own mapper is to be used.

    Raises InvalidArgument for a fabric map that is malformed or does not list this host,
    FailedPrecondition when the service cannot be reached or does not match the map.
    """
    if config.redfish_map is None:
        return None
    from dxpool.hostagent.drivers.redfish import connect_redfish_mapper
    from dxpool.redfish.fabric_map import load_fabric_map

    fabric_map = load_fabric_map(config.redfish_map)
    if config.host_id not in fabric_map.hosts:
        raise InvalidArgument(
            f"host {config.host_id!r} is not in the Redfish fabric map {config.redfish_map}; "
            "add it under hosts: with its endpoint and its zones"
        )
    entry = fabric_map.hosts[config.host_id]
    if entry.slots < config.slot_capacity:
        given = f"a port zone of {entry.slots} slots" if entry.per_port else f"{entry.slots} zones"
        raise InvalidArgument(
            f"the Redfish fabric map gives host {config.host_id!r} {given} for "
            f"{config.slot_capacity} slots; give it as many or pass --slot-capacity {entry.slots}"
        )
    try:
        return connect_redfish_mapper(fabric_map, config.host_id, state_dir=config.state_dir)
    except DriverError as error:
        raise FailedPrecondition(f"Redfish fabric map {config.redfish_map}: {error}") from error


def build_driver(config: AgentConfig) -> FabricDriver:
    """The driver ``config.driver`` names, ready to use.

    Raises InvalidArgument for an unknown driver name or a configuration the driver
    cannot use, FailedPrecondition when its hardware (or simulated fabric) is not there.
    """
    builder = DRIVERS.get(config.driver)
    if builder is None:
        raise InvalidArgument(
            f"unknown fabric driver {config.driver!r}: choose one of {', '.join(sorted(DRIVERS))}"
        )
    return builder(config)


__all__ = ["DRIVERS", "build_driver", "build_proxy_mapper"]
