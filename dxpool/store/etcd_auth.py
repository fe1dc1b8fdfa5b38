"""etcd users and roles for a pool: who may read and write which keys of etcd.

With etcd's authentication on and ``--client-cert-auth``, etcd names the user of a call
by the Common Name of its client certificate (:mod:`dxpool.etcd_users`), and refuses
(``PERMISSION_DENIED``) any key the user's roles do not grant. This module holds the
permission table of a pool and applies it through etcd's own Auth API.

=======================  ====================================  ============================
user                     grants (below the pool's prefix P)    why
=======================  ====================================  ============================
``root``                 everything (etcd's built-in role)     changes users and roles
``dxpool-broker``        read/write ``P*`` and ``{P-}audit/*``  the whole pool, its elections,
                                                               the agents' liveness records
                                                               and its audit log
=======================  ====================================  ============================

Host agents have no etcd user: they hold no etcd credentials and reach the pool only
through a broker's agent port (:mod:`dxpool.broker.api.agent_service`). Older versions gave
each agent a user ``dxpool-agent-{host}`` with its own host's keys; :func:`setup_pool`
removes such users, so a certificate that once was an agent's can do nothing to etcd.
The TLS layer keeps hosts out first: etcd should trust a CA of its own that signs only
the brokers' and operators' certificates (see ``dxpool up``), so a host's certificate
fails the handshake and never reaches these checks.

Every function here is idempotent: :func:`ensure_user` makes a role's permissions exactly
the table's (grants what is missing, revokes what is not in it), so running setup again
repairs a role edited by hand. Users are made without a password (etcd's
``UserAddOptions.no_password``): only a certificate with their CN can act as them.

Before authentication is enabled anyone may call the Auth API; afterwards only ``root``,
so these functions must then run with root's certificate. etcd refuses to enable
authentication until ``root`` exists with the ``root`` role; :meth:`EtcdAuth.enable`
makes sure, and refuses to turn it on over a connection that does not show root's
certificate: with users that have no password, that would lock everyone out for good.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import grpc
from cryptography import x509
from cryptography.x509.oid import NameOID
from etcd3 import etcdrpc, utils
from etcd3.etcdrpc import auth_pb2

from dxpool.errors import DxpoolError, FailedPrecondition, PermissionDenied, Unavailable
from dxpool.etcd_users import AGENT_USER_PREFIX, BROKER_USER, ROOT_USER
from dxpool.store.client import REQUIRE_LEADER, EtcdAddress, channel
from dxpool.store.keys import KeySchema
from dxpool.tls import read_pem

__all__ = [
    "ROOT_ROLE",
    "Access",
    "EtcdAuth",
    "Grant",
    "PoolUsers",
    "RoleView",
    "broker_grants",
    "remove_agent_users",
    "role_of",
    "setup_pool",
]

DEFAULT_TIMEOUT_S = 5.0
ROOT_ROLE = "root"
# AuthUserAddRequest.options (field 3) = UserAddOptions{no_password: true}. The request
# message python3-etcd3 generates predates the field; protobuf keeps these bytes as an
# unknown field and sends them, and etcd (3.4 and later) reads them.
_NO_PASSWORD_OPTION = b"\x1a\x02\x08\x01"
# etcd's ErrUserNotFound / ErrRoleNotFound texts.
_USER_NOT_FOUND = "user name not found"
_ROLE_NOT_FOUND = "role name not found"


class Access(IntEnum):
    """What a grant allows; the values are etcd's ``authpb.Permission.Type``."""

    READ = auth_pb2.Permission.READ
    WRITE = auth_pb2.Permission.WRITE
    READWRITE = auth_pb2.Permission.READWRITE


@dataclass(frozen=True, order=True)
class Grant:
    """One etcd permission: ``key`` alone (``range_end`` empty) or ``[key, range_end)``."""

    key: bytes
    range_end: bytes
    access: Access

    @classmethod
    def one_key(cls, key: str, access: Access) -> Grant:
        return cls(key.encode(), b"", access)

    @classmethod
    def prefix(cls, prefix: str, access: Access) -> Grant:
        """Every key that starts with ``prefix``."""
        encoded = prefix.encode()
        return cls(encoded, utils.prefix_range_end(encoded), access)

    def describe(self) -> str:
        """``read/write /dxpool/v1/*`` or ``read /dxpool/v1/hostalloc/h1``."""
        words = {Access.READ: "read", Access.WRITE: "write", Access.READWRITE: "read/write"}
        key = self.key.decode(errors="replace")
        if not self.range_end:
            return f"{words[self.access]} {key}"
        if self.range_end == utils.prefix_range_end(self.key):
            return f"{words[self.access]} {key}*"
        return f"{words[self.access]} [{key}, {self.range_end.decode(errors='replace')})"


def broker_grants(keys: KeySchema) -> tuple[Grant, ...]:
    """The broker's: the whole pool prefix (elections included) and the audit log."""
    return (
        Grant.prefix(keys.prefix, Access.READWRITE),
        Grant.prefix(keys.audit_prefix, Access.READWRITE),
    )


def role_of(user: str) -> str:
    """The role that holds a dxpool user's grants: named like the user."""
    return user


@dataclass(frozen=True)
class RoleView:
    """A user as etcd holds it: its roles and each role's grants."""

    user: str
    roles: dict[str, tuple[Grant, ...]]


class EtcdAuth:
    """etcd's Auth API on one member (``address`` carries the TLS to reach it).

    Every method raises :class:`~dxpool.errors.PermissionDenied` when etcd refuses the
    caller (authentication is on and the certificate is not root's),
    :class:`~dxpool.errors.Unavailable` when etcd cannot be reached, and
    :class:`~dxpool.errors.FailedPrecondition` for other refusals, each naming what to do.
    """

    def __init__(self, address: EtcdAddress, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._address = address
        self._timeout_s = timeout_s
        self._channel = channel(address)
        self._stub = etcdrpc.AuthStub(self._channel)
        self._admin_checked = False

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EtcdAuth:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- raw calls -------------------------------------------------------------------

    def _call(self, method: str, request: Any) -> Any:
        if not self._admin_checked:
            self._check_admin()
        return self._raw_call(method, request)

    def _check_admin(self) -> None:
        """Ask etcd whether the caller may use the Auth API at all, once, before anything
        else: etcd answers "user name not found" both for a caller whose CN is no user
        and for a missing user or role asked about, so the caller is judged first."""
        try:
            self._raw_call("UserList", etcdrpc.AuthUserListRequest())
        except FailedPrecondition as error:
            if _USER_NOT_FOUND in error.message:
                raise self._denied("UserList", "the certificate's CN is no etcd user") from error
            raise
        self._admin_checked = True

    def _raw_call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(
                request, timeout=self._timeout_s, metadata=REQUIRE_LEADER
            )
        except grpc.RpcError as error:
            raise self._translate(method, error) from error

    def _translate(self, method: str, error: grpc.RpcError) -> DxpoolError:
        code = error.code() if hasattr(error, "code") else None
        details = (error.details() if hasattr(error, "details") else "") or str(error)
        where = f"etcd at {self._address}"
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return self._denied(method, details)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return Unavailable(
                f"{where} did not answer {method} ({details}); check the endpoint and the "
                "TLS files",
                reason="ETCD_UNAVAILABLE",
            )
        return FailedPrecondition(f"{where} refused {method}: {details}", reason="ETCD_AUTH")

    def _denied(self, method: str, details: str) -> PermissionDenied:
        return PermissionDenied(
            f"etcd at {self._address} refused {method} ({details}): authentication is on, "
            f"so users and roles can only be changed with a client certificate whose CN is "
            f"{ROOT_USER!r} (`dxpool certs issue --etcd-user {ROOT_USER}`)",
            reason="ETCD_PERMISSION_DENIED",
        )

    def _absent(self, method: str, request: Any, not_found: str) -> Any | None:
        """Call ``method``; None when etcd answers ``not_found`` (the user or role asked
        about does not exist)."""
        try:
            return self._call(method, request)
        except FailedPrecondition as error:
            if not_found in error.message:
                return None
            raise

    # -- reading ---------------------------------------------------------------------

    def users(self) -> list[str]:
        return sorted(self._call("UserList", etcdrpc.AuthUserListRequest()).users)

    def user_roles(self, user: str) -> list[str] | None:
        """The roles of ``user``; None when there is no such user."""
        response = self._absent("UserGet", etcdrpc.AuthUserGetRequest(name=user), _USER_NOT_FOUND)
        return None if response is None else sorted(response.roles)

    def role_grants(self, role: str) -> tuple[Grant, ...] | None:
        """The grants of ``role``, sorted; None when there is no such role."""
        response = self._absent("RoleGet", etcdrpc.AuthRoleGetRequest(role=role), _ROLE_NOT_FOUND)
        if response is None:
            return None
        return tuple(sorted(Grant(p.key, p.range_end, Access(p.permType)) for p in response.perm))

    def view(self, user: str) -> RoleView | None:
        """``user`` with its roles and their grants; None when there is no such user."""
        roles = self.user_roles(user)
        if roles is None:
            return None
        return RoleView(
            user,
            {role: () if role == ROOT_ROLE else self.role_grants(role) or () for role in roles},
        )

    # -- changing --------------------------------------------------------------------

    def ensure_user(self, user: str, grants: Iterable[Grant]) -> bool:
        """Make ``user`` exist (without a password) holding its role, and make that role's
        grants exactly ``grants``. Returns whether anything changed."""
        role = role_of(user)
        wanted = set(grants)
        changed = False
        current = self.role_grants(role)
        if current is None:
            self._call("RoleAdd", etcdrpc.AuthRoleAddRequest(name=role))
            current, changed = (), True
        for grant in sorted(set(current) - wanted):
            self._call(
                "RoleRevokePermission",
                etcdrpc.AuthRoleRevokePermissionRequest(
                    role=role, key=grant.key, range_end=grant.range_end
                ),
            )
            changed = True
        # A grant of the same range with another access replaces the old one in etcd.
        for grant in sorted(wanted - set(current)):
            self._call(
                "RoleGrantPermission",
                etcdrpc.AuthRoleGrantPermissionRequest(
                    name=role,
                    perm=auth_pb2.Permission(
                        permType=int(grant.access), key=grant.key, range_end=grant.range_end
                    ),
                ),
            )
            changed = True
        return self._ensure_user_role(user, role) or changed

    def _ensure_user_role(self, user: str, role: str) -> bool:
        roles = self.user_roles(user)
        changed = False
        if roles is None:
            self._call("UserAdd", _user_add_request(user))
            roles, changed = [], True
        if role not in roles:
            self._call("UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user=user, role=role))
            changed = True
        return changed

    def remove_user(self, user: str) -> bool:
        """Delete ``user`` and its role; False when neither existed."""
        user_gone = self._absent(
            "UserDelete", etcdrpc.AuthUserDeleteRequest(name=user), _USER_NOT_FOUND
        )
        role_gone = self._absent(
            "RoleDelete", etcdrpc.AuthRoleDeleteRequest(role=role_of(user)), _ROLE_NOT_FOUND
        )
        return user_gone is not None or role_gone is not None

    def enable(self) -> None:
        """Make sure ``root`` exists with the ``root`` role, then turn authentication on
        (etcd answers success when it is already on).

        Refuses (:class:`~dxpool.errors.FailedPrecondition`, ``ETCD_AUTH_LOCKOUT``) unless
        this connection shows a client certificate whose CN is ``root``: users here have
        no password, so once authentication is on only certificates name them, and
        turning it on from anything else (plaintext, another user's certificate) would
        leave no one able to change users again, or to turn it off."""
        self.check_root_certificate()
        self._ensure_user_role(ROOT_USER, ROOT_ROLE)
        self._call("AuthEnable", etcdrpc.AuthEnableRequest())

    def check_root_certificate(self) -> None:
        """FailedPrecondition (``ETCD_AUTH_LOCKOUT``) unless this connection shows a client
        certificate whose CN is ``root``; see :meth:`enable`. Reads only the local file."""
        tls = self._address.tls
        names: list[str] = []
        if tls is not None and tls.cert is not None:
            cert = x509.load_pem_x509_certificate(read_pem(tls.cert, "client certificate"))
            names = [str(n.value) for n in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
        if names != [ROOT_USER]:
            shown = (
                f"a certificate with CN {', '.join(names) or '(none)'}"
                if tls and tls.cert
                else "no client certificate"
            )
            raise FailedPrecondition(
                f"not turning etcd's authentication on with {shown}: etcd users have no "
                f"password and are named by their certificate's CN, so only a TLS "
                f"connection with CN {ROOT_USER!r} (`dxpool certs issue --etcd-user "
                f"{ROOT_USER}`) could still manage them afterwards; connect with that "
                "certificate (--etcd-ca, --etcd-cert, --etcd-key)",
                reason="ETCD_AUTH_LOCKOUT",
            )


def _user_add_request(user: str) -> Any:
    """A UserAdd request for ``user`` with no password (see ``_NO_PASSWORD_OPTION``)."""
    plain = etcdrpc.AuthUserAddRequest(name=user).SerializeToString()
    return etcdrpc.AuthUserAddRequest.FromString(plain + _NO_PASSWORD_OPTION)


@dataclass(frozen=True)
class PoolUsers:
    """What :func:`setup_pool` did: users created or changed, and leftover agent users
    removed."""

    changed: list[str]
    removed: list[str]


def remove_agent_users(auth: EtcdAuth) -> list[str]:
    """Delete every agent user older versions made (``dxpool-agent-*``) and its role;
    returns their names. Idempotent."""
    removed = []
    for user in auth.users():
        if user.startswith(AGENT_USER_PREFIX) and auth.remove_user(user):
            removed.append(user)
    return removed


def setup_pool(
    auth: EtcdAuth,
    keys: KeySchema,
    *,
    broker: bool = True,
    enable: bool = True,
) -> PoolUsers:
    """Give the broker (``broker``) exactly its grants, remove leftover agent users,
    then (``enable``) make sure ``root`` exists and authentication is on.

    Idempotent. Refuses (``ETCD_AUTH_LOCKOUT``) before changing anything when it is to
    turn authentication on without root's certificate (see :meth:`EtcdAuth.enable`)."""
    if enable:  # before any change: a setup that cannot finish changes nothing
        auth.check_root_certificate()
    changed = [BROKER_USER] if broker and auth.ensure_user(BROKER_USER, broker_grants(keys)) else []
    removed = remove_agent_users(auth)
    if enable:
        auth.enable()
    return PoolUsers(changed, removed)
