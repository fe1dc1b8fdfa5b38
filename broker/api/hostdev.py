"""libvirt ``<hostdev>`` XML for a READY node's GPUs: the hand-off of a node to a VM.

A node composed with ``spec.vfio`` has its GPUs bound to ``vfio-pci`` on its host by the
host agent, which reports each device's PCI address (the node's bindings carry it once
the node is READY). A VM defined on that host takes the GPUs with one element each::

    <hostdev mode='subsystem' type='pci' managed='no'>
      <source>
        <address domain='0x0000' bus='0x41' slot='0x00' function='0x0'/>
      </source>
    </hostdev>

``managed='no'``: libvirt must not rebind the device - dxpool's agent owns the binding,
and a detach by libvirt would put the GPU back on a host driver behind the agent's back.

:func:`node_hostdev` is pure: it reads the node record only and raises
:class:`~dxpool.errors.FailedPrecondition` when the node cannot be handed off yet.
"""

from __future__ import annotations

import re
from xml.etree import ElementTree

from dxpool import lifecycle
from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.errors import FailedPrecondition

# domain:bus:slot.function, as sysfs and lspci -D print it.
BDF_PATTERN = re.compile(
    r"\A(?P<domain>[0-9a-fA-F]{4}):(?P<bus>[0-9a-fA-F]{2}):(?P<slot>[0-1][0-9a-fA-F])\."
    r"(?P<function>[0-7])\Z"
)


def hostdev_element(bdf: str) -> str:
    """The ``<hostdev>`` element for the PCI device at ``bdf`` ("0000:41:00.0").

    Raises ValueError for an address that is not domain:bus:slot.function.
    """
    match = BDF_PATTERN.fullmatch(bdf)
    if match is None:
        raise ValueError(f"{bdf!r} is not a PCI address (domain:bus:slot.function)")
    hostdev = ElementTree.Element("hostdev", {"mode": "subsystem", "type": "pci", "managed": "no"})
    source = ElementTree.SubElement(hostdev, "source")
    ElementTree.SubElement(
        source,
        "address",
        {
            "domain": f"0x{match['domain'].lower()}",
            "bus": f"0x{match['bus'].lower()}",
            "slot": f"0x{match['slot'].lower()}",
            "function": f"0x{match['function']}",
        },
    )
    ElementTree.indent(hostdev, space="  ")
    return ElementTree.tostring(hostdev, encoding="unicode")


def _state_name(state: int) -> str:
    found = pb.NodeState.DESCRIPTOR.values_by_number.get(state)
    return found.name.removeprefix("NODE_STATE_") if found is not None else str(state)


def node_hostdev(node: pb.VirtualNode) -> nodes_pb2.NodeHostdev:
    """The host devices of ``node``, one per GPU binding, in binding order.

    FailedPrecondition when the node is not READY (its GPUs are not bound yet, or no
    longer), was composed without ``vfio`` (its GPUs are on the host's driver), or a
    binding lacks a valid PCI address.
    """
    if node.state in lifecycle.ATTACHING_NODE_STATES:
        raise FailedPrecondition(
            f"node {node.name} is {_state_name(node.state)}, not READY: its GPUs are not "
            "bound on its host yet; retry once it is READY (see `dxpool node watch`)",
            reason="NODE_NOT_READY",
        )
    if node.state != pb.NODE_STATE_READY:
        raise FailedPrecondition(
            f"node {node.name} is {_state_name(node.state)}, not READY, and will not be "
            "again: its GPUs are going or gone; compose a new node with --vfio",
            reason="NODE_NOT_READY",
        )
    if not node.spec.vfio:
        raise FailedPrecondition(
            f"node {node.name} was composed without vfio, so its GPUs are bound to the host's "
            "driver and a VM cannot take them; release it and compose it again with --vfio",
            reason="NODE_NOT_VFIO",
        )
    devices = []
    for binding in node.gpus:
        try:
            xml = hostdev_element(binding.bdf)
        except ValueError as error:
            raise FailedPrecondition(
                f"node {node.name}: {binding.gpu} has no usable PCI address ({error}); its host "
                "agent did not report one - see `dxpool node get` and the agent's log",
                reason="NO_PCI_ADDRESS",
            ) from error
        devices.append(nodes_pb2.GpuHostdev(gpu=binding.gpu, bdf=binding.bdf, xml=xml))
    return nodes_pb2.NodeHostdev(
        name=node.name,
        host=node.host,
        devices=devices,
        xml="".join(device.xml + "\n" for device in devices),
    )


__all__ = ["hostdev_element", "node_hostdev"]
