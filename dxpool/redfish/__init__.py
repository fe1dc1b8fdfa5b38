"""A DMTF Redfish fabric manager, as dxpool's host agents and brokers both use it.

* :mod:`.fabric_map` - the YAML fabric map: the service, and which Redfish endpoint or
  zone is which host, host slot and GPU;
* :mod:`.session` - one logged-in session and the errors of a call;
* :mod:`.tasks` - following an operation the service runs asynchronously (202 and its
  task monitor) to its end;
* :mod:`.zones` - the fabric's Zones and Endpoints: lookups, membership changes through
  the zone actions (or PATCH where a service has none) conditional on ETags, and retries
  of the operations that are safe to redo.

The host agent's Redfish proxy mapper (``dxpool.hostagent.drivers.redfish``) maps and
unmaps its own host's slots; the broker's Redfish box fabric
(``dxpool.broker.control.box_fabric_redfish``) revokes a GPU's every mapping when it fences.
Both need the ``redfish`` module (the ``agent`` and ``server`` extras bring it).
"""
