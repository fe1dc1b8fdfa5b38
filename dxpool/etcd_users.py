"""The etcd user names of a pool, shared by certificate issuance and etcd's auth setup.

With etcd's authentication enabled and ``--client-cert-auth``, etcd takes the user of a
call from the Common Name of the client certificate. So a certificate's CN decides what
its holder may do to etcd, and these names tie the two together:

* :data:`ROOT_USER` (``root``): etcd's administrator; only it may change users and
  roles once authentication is on. ``dxpool etcd-auth`` runs with its certificate.
* :data:`BROKER_USER` (``dxpool-broker``): every broker of the pool.
* :func:`agent_user` (``dxpool-agent-{host}``): the user older versions gave the agent of
  one host. Agents have no etcd user now (they reach the pool through a broker);
  ``dxpool etcd-auth setup`` removes these.

This module needs no etcd client, so the base install (which issues certificates)
can use it.
"""

from __future__ import annotations

from typing import Final

from dxpool.names import check_id

__all__ = ["AGENT_USER_PREFIX", "BROKER_USER", "ROOT_USER", "agent_user"]

ROOT_USER: Final = "root"
BROKER_USER: Final = "dxpool-broker"
AGENT_USER_PREFIX: Final = "dxpool-agent-"


def agent_user(host: str) -> str:
    """``h1`` -> ``dxpool-agent-h1``, the etcd user older versions gave ``host``'s agent;
    InvalidArgument when ``host`` is not a valid id."""
    check_id(host, "host")
    return f"{AGENT_USER_PREFIX}{host}"
