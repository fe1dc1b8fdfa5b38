"""Who calls the broker: an identity is a role and a name.

The one encoding, in certificates and token files alike, is the URI
``dxpool://ROLE/NAME``: ``dxpool://operator/alice``, ``dxpool://tenant/team-a``,
``dxpool://agent/h7``. A client certificate carries it as its one ``dxpool://`` URI in
the subject alternative names; a token file maps a token to it.

Roles (what each may call is the broker's table, :mod:`dxpool.broker.api.auth`):

* ``operator``: everything — inventory, cordon, reclaim, any node, force-release;
* ``tenant``: an orchestrator acting for one tenant: compose, plan, release and watch
  its own nodes only;
* ``agent``: a host agent, for its own host (``NAME`` is the host id).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from dxpool import names
from dxpool.errors import InvalidArgument

__all__ = ["SCHEME", "Identity", "Role"]

SCHEME = "dxpool"


class Role(StrEnum):
    OPERATOR = "operator"
    TENANT = "tenant"
    AGENT = "agent"


@dataclass(frozen=True)
class Identity:
    """A caller: ``role`` and ``name`` (a resource id: letters, digits, ``.``, ``_``, ``-``)."""

    role: Role
    name: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}://{self.role.value}/{self.name}"

    def __str__(self) -> str:
        return self.uri

    @classmethod
    def make(cls, role: str, name: str) -> Identity:
        """An identity from its parts; InvalidArgument if the role or name is unknown/bad."""
        try:
            known = Role(role)
        except ValueError:
            raise InvalidArgument(
                f"unknown role {role!r}: expected one of {', '.join(r.value for r in Role)}",
                reason="INVALID_ROLE",
            ) from None
        names.check_id(name, f"{role} name")
        return cls(known, name)

    @classmethod
    def parse(cls, uri: str) -> Identity:
        """``dxpool://tenant/team-a`` -> Identity; InvalidArgument naming the grammar."""
        prefix = f"{SCHEME}://"
        role, sep, name = uri.removeprefix(prefix).partition("/")
        if not uri.startswith(prefix) or not sep:
            raise InvalidArgument(
                f"invalid identity {uri!r}: expected {prefix}ROLE/NAME, e.g. {prefix}tenant/team-a",
                reason="INVALID_IDENTITY",
            )
        return cls.make(role, name)
