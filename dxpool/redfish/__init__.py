"""A DMTF Redfish fabric manager, as dxpool's host agents and brokers both use it.

* :mod:`.fabric_map` - the YAML fabric map: the service, and which Redfish endpoint or
  zone is which host, host slot and GPU;
* :mod:`.session` - one logged-in session and the errors of a call;
* :mod:`.zones` - the fabric's Zones and Endpoints: reads, conditional writes, and
  retries of the operations that are safe to redo.

The host agent's Redfish proxy mapper (``dxpool.hostagent.drivers.redfish``) maps and
unmaps its own host's slots; the broker's Redfish box fabric
(``dxpool.broker.box_fabric_redfish``) revokes a GPU's every mapping when it fences.
Both need the ``redfish`` module (the ``agent`` and ``server`` extras bring it).
"""
