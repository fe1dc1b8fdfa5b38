"""dxpool: a control plane for disaggregated GPU pools.

The broker keeps an inventory of GPU boxes and hosts in etcd and composes virtual nodes
(one host plus GPUs drawn from any boxes); host agents attach and detach the GPUs over
the PCIe fabric. ``dxpool.client`` is the Python client for orchestrators.
"""

__version__ = "0.1.0"
