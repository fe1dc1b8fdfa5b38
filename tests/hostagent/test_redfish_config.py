"""The Redfish fabric map: loading, checking, and selecting the mapper from the agent."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dxpool.errors import FailedPrecondition, InvalidArgument
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.drivers import build_driver, build_proxy_mapper
from dxpool.hostagent.drivers.redfish import RedfishProxyMapper
from dxpool.names import GpuRef
from dxpool.redfish.fabric_map import (
    AuthMethod,
    Membership,
    RedfishScrub,
    ResetAction,
    ZoneLookup,
    load_fabric_map,
)

from .redfish_service import (
    FABRIC,
    PASSWORD,
    USERNAME,
    RedfishFabricService,
    install,
    running_service,
    self_signed_cert,
)


def document(url: str = "https://127.0.0.1:8443", **service: Any) -> dict[str, Any]:
    return {
        "service": {
            "url": url,
            "fabric": FABRIC,
            "username": USERNAME,
            "password_file": "password",
            **service,
        },
        "hosts": {
            "h1": {"endpoint": "HostPort-h1", "zones": ["h1-s0", "h1-s1"]},
            "h2": {"endpoint": "HostPort-h2", "zones": ["h2-s0"]},
        },
        "boxes": {"b1": [f"GPU-b1-{slot}" for slot in range(4)]},
    }


def write(tmp_path: Path, content: dict[str, Any]) -> Path:
    (tmp_path / "password").write_text(PASSWORD + "\n")
    path = tmp_path / "fabric.yaml"
    path.write_text(yaml.safe_dump(content))
    return path


def test_load_reads_the_map_and_resolves_files_next_to_it(tmp_path: Path) -> None:
    loaded = load_fabric_map(write(tmp_path, document(ca_bundle="ca.pem", timeout_s=2)))

    assert loaded.service.password == PASSWORD
    assert loaded.service.ca_bundle == tmp_path / "ca.pem"
    assert loaded.service.timeout_s == 2.0
    assert loaded.service.verify is True
    assert loaded.hosts["h1"].zones == ("h1-s0", "h1-s1")
    assert loaded.gpu_endpoint(GpuRef("b1", 3)) == "GPU-b1-3"
    assert loaded.gpu_endpoint(GpuRef("b1", 4)) is None
    assert loaded.gpu_of("GPU-b1-2") == GpuRef("b1", 2)
    assert loaded.gpu_of("HostPort-h1") is None
    assert loaded.host_of_zone("h2-s0") == "h2"
    assert PASSWORD not in repr(loaded.service)
    # the defaults: sessions, actions where offered, Links.Zones once proved, Processor.Reset
    assert loaded.service.auth is AuthMethod.SESSION
    assert loaded.service.membership is Membership.AUTO
    assert loaded.service.zone_lookup is ZoneLookup.AUTO
    assert loaded.scrub == RedfishScrub()


def test_load_reads_a_zone_per_host_port_and_the_scrub_section(tmp_path: Path) -> None:
    content = document(auth="basic", membership="actions", zone_lookup="scan", task_timeout_s=30)
    content["hosts"]["h3"] = {"endpoint": "I3", "zone": 3, "slots": 4}  # DMTF numbers zones
    content["scrub"] = {
        "actions": [
            "#Processor.Reset",
            {"name": "#Oem.Contoso.ResetGpu", "parameters": {"Mode": "Full"}},
        ],
        "hook": "scrub-hook",
        "hook_timeout_s": 5,
    }
    loaded = load_fabric_map(write(tmp_path, content))

    port = loaded.hosts["h3"]
    assert (port.zones, port.per_port, port.slots) == (("3",), True, 4)
    assert [port.zone_for_slot(s) for s in (0, 3, 4)] == ["3", "3", None]
    assert loaded.hosts["h1"].zone_for_slot(1) == "h1-s1"
    assert loaded.service.auth is AuthMethod.BASIC
    assert loaded.service.membership is Membership.ACTIONS
    assert loaded.service.zone_lookup is ZoneLookup.SCAN
    assert loaded.service.task_timeout_s == 30.0
    assert loaded.scrub.actions == (
        ResetAction("#Processor.Reset"),
        ResetAction("#Oem.Contoso.ResetGpu", {"Mode": "Full"}),
    )
    assert loaded.scrub.hook == tmp_path / "scrub-hook"
    assert loaded.scrub.hook_timeout_s == 5.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"service": {"url": "ftp://x"}}, "must be the service's address"),
        ({"service": {"verify": "yes"}}, "service.verify must be true or false"),
        ({"service": {"attempts": 0}}, "service.attempts must be 1..10"),
        ({"service": {"timeout_s": -1}}, "service.timeout_s must be a number > 0"),
        ({"service": {"fabric": "PCIe/../x"}}, "is not a Redfish id"),
        ({"service": {"colour": "red"}}, "unknown key(s) colour in service"),
        ({"hosts": {"h1": {"endpoint": "HostPort-h1", "zones": []}}}, "non-empty list"),
        ({"hosts": {"H 1": {"endpoint": "e", "zones": ["z"]}}}, "invalid host id"),
        ({"boxes": {"b1": ["HostPort-h1"]}}, "is given to both host h1 and GPU b1/0"),
        ({"hosts": {"h3": {"endpoint": "e3", "zones": ["h1-s0"]}}}, "'h1-s0' is given to both"),
        ({"hosts": {"h3": {"endpoint": "e3"}}}, "needs either zones: (one zone per host slot)"),
        (
            {"hosts": {"h3": {"endpoint": "e3", "zones": ["z"], "zone": "z"}}},
            "needs either zones:",
        ),
        ({"hosts": {"h3": {"endpoint": "e3", "zone": "z"}}}, "hosts.h3.slots must be 1..256"),
        ({"hosts": {"h3": {"endpoint": "e3", "zone": "z", "slots": 0}}}, "slots must be 1..256"),
        (
            {"hosts": {"h3": {"endpoint": "e3", "zones": ["z"], "slots": 2}}},
            "hosts.h3.slots goes with zone:",
        ),
        (
            {"hosts": {"h3": {"endpoint": "e3", "zone": "h2-s0", "slots": 2}}},
            "'h2-s0' is given to both slot 0 of host h2 and the port of host h3",
        ),
        ({"service": {"auth": "kerberos"}}, "service.auth must be one of session, basic"),
        ({"service": {"membership": "put"}}, "service.membership must be one of auto, actions"),
        ({"service": {"zone_lookup": "guess"}}, "service.zone_lookup must be one of auto"),
        ({"service": {"task_timeout_s": 0}}, "service.task_timeout_s must be a number > 0"),
        ({"scrub": {"actions": "#Processor.Reset"}}, "scrub.actions must be a list"),
        ({"scrub": {"actions": ["Processor.Reset"]}}, "is not an action name"),
        ({"scrub": {"actions": []}}, "scrub needs at least one action or a hook"),
        ({"scrub": {"actions": [{"name": "#A.B", "body": {}}]}}, "unknown key(s) body"),
    ],
)
def test_bad_maps_name_what_to_fix(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    content = document()
    for section, values in change.items():
        content.setdefault(section, {}).update(values)
    with pytest.raises(InvalidArgument) as raised:
        load_fabric_map(write(tmp_path, content))
    assert message in raised.value.message


def test_a_missing_password_file_or_map_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, document())
    (tmp_path / "password").unlink()
    with pytest.raises(InvalidArgument, match=r"cannot read service\.password_file"):
        load_fabric_map(path)
    with pytest.raises(InvalidArgument, match="cannot read the Redfish fabric map"):
        load_fabric_map(tmp_path / "absent.yaml")


# -- selection from the agent's config ------------------------------------------------------


@pytest.fixture
def https_service(tmp_path: Path) -> Iterator[tuple[RedfishFabricService, Path]]:
    cert, key = self_signed_cert(tmp_path)
    fabric = RedfishFabricService()
    install(fabric)
    with running_service(fabric, tls=(cert, key)) as running:
        yield running, cert


def test_no_map_selects_the_drivers_own_mapper() -> None:
    assert build_proxy_mapper(AgentConfig(host_id="h1")) is None


def test_the_agent_config_selects_the_redfish_mapper(
    tmp_path: Path, https_service: tuple[RedfishFabricService, Path]
) -> None:
    service, cert = https_service
    path = write(tmp_path, document(service.url, ca_bundle=str(cert)))

    mapper = build_proxy_mapper(AgentConfig(host_id="h1", slot_capacity=2, redfish_map=path))

    assert isinstance(mapper, RedfishProxyMapper)
    mapper.map(GpuRef("b1", 0), 1, generation=1)
    assert service.zone("h1-s1") == ["HostPort-h1", "GPU-b1-0"]
    mapper.close()


def test_selection_refuses_a_host_or_slots_the_map_lacks(
    tmp_path: Path, https_service: tuple[RedfishFabricService, Path]
) -> None:
    service, cert = https_service
    path = write(tmp_path, document(service.url, ca_bundle=str(cert)))
    with pytest.raises(InvalidArgument, match="host 'h7' is not in the Redfish fabric map"):
        build_proxy_mapper(AgentConfig(host_id="h7", redfish_map=path))
    with pytest.raises(InvalidArgument, match="gives host 'h1' 2 zones for 8 slots"):
        build_proxy_mapper(AgentConfig(host_id="h1", slot_capacity=8, redfish_map=path))


def test_selection_fails_its_precondition_when_the_service_does_not_match(
    tmp_path: Path, https_service: tuple[RedfishFabricService, Path]
) -> None:
    service, cert = https_service
    content = document(service.url, ca_bundle=str(cert))
    content["boxes"]["b2"] = ["GPU-b2-0"]
    path = write(tmp_path, content)
    with pytest.raises(FailedPrecondition, match="endpoint GPU-b2-0 \\(GPU b2/0\\) does not"):
        build_proxy_mapper(AgentConfig(host_id="h1", slot_capacity=2, redfish_map=path))


def test_the_sim_driver_refuses_a_redfish_map(tmp_path: Path) -> None:
    config = AgentConfig(
        host_id="h1", sim_state_dir=tmp_path, redfish_map=write(tmp_path, document())
    )
    with pytest.raises(InvalidArgument, match="--redfish-map is for a driver of real hosts"):
        build_driver(config)


def test_the_operations_guide_fabric_map_loads_as_written(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md").read_text()
    example = next(
        block
        for block in re.findall(r"```yaml\n(.*?)```", readme, re.DOTALL)
        if "password_file" in block
    )
    (tmp_path / "redfish.password").write_text("secret\n")
    (tmp_path / "fabric-map.yaml").write_text(example)

    loaded = load_fabric_map(tmp_path / "fabric-map.yaml")

    assert loaded.hosts["h1"].slots == 2 and not loaded.hosts["h1"].per_port
    assert loaded.hosts["h2"].slots == 4 and loaded.hosts["h2"].per_port
    assert loaded.gpu_of("GPU-b1-3") == GpuRef("b1", 3)
    assert loaded.scrub.hook == Path("/usr/local/libexec/dxpool-scrub")


def test_selection_counts_the_slots_of_a_port_zone(tmp_path: Path) -> None:
    content = document()
    content["hosts"]["h3"] = {"endpoint": "HostPort-h3", "zone": "h3-port", "slots": 2}
    path = write(tmp_path, content)
    with pytest.raises(InvalidArgument, match="gives host 'h3' a port zone of 2 slots for 8"):
        build_proxy_mapper(AgentConfig(host_id="h3", slot_capacity=8, redfish_map=path))


def test_reset_parameters_are_not_printed() -> None:
    action = ResetAction("#Contoso.SecureErase", {"Passphrase": "hunter2"})
    assert "hunter2" not in repr(action)
    assert "Passphrase" in repr(action)
