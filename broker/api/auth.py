"""Who may call what: authentication and the one table of roles per RPC.

Authentication (:class:`Authenticator`) finds the caller's :class:`~dxpool.identity.Identity`:

* on a broker with a client CA, the client certificate the TLS handshake verified
  (mutual TLS), which must carry exactly one ``dxpool://ROLE/NAME`` SAN URI;
* on a broker with a token file, a bearer token (``authorization: Bearer TOKEN``
  metadata) looked up in a :class:`TokenTable` — for orchestrators that cannot hold
  certificates. A broker does one or the other (see ``BrokerServer``).

Authorization (:class:`Authorizer`, a server interceptor) checks every call to a dxpool
service against :data:`RULES`, the only place that says which roles may call each RPC
(a test holds it to every method of the service descriptors), before the servicer runs:

* no identity: UNAUTHENTICATED (say how to authenticate);
* a role the RPC does not allow: PERMISSION_DENIED naming the roles that may;
* an agent naming a host other than its own, a tenant naming another tenant (a
  compose charged to it, its quota), or a tenant asking for what only an operator may
  do (``ReleaseNode`` with ``force``): PERMISSION_DENIED.

A denied call never reaches the servicer, so it changes nothing. Which *nodes* a tenant
sees is data, not method: NodeService scopes to the owner (:func:`owner_scope`). Health
checking and reflection need no identity (load balancers and ``grpcurl`` use them).
With authentication off (no client CA, no tokens) the interceptor is not installed and
every call behaves as without it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml
from cryptography import x509

from dxpool.api.v1 import audit_pb2, fabric_pb2, inventory_pb2, nodes_pb2
from dxpool.broker.api.decoding import Handler, Interceptor
from dxpool.broker.api.rpc import to_status
from dxpool.errors import DxpoolError, InvalidArgument, PermissionDenied, Unauthenticated
from dxpool.identity import Identity, Role
from dxpool.pki import identities_in
from dxpool.private_files import check_private

__all__ = [
    "RULES",
    "Authenticator",
    "Authorizer",
    "Rule",
    "TokenTable",
    "owner_scope",
]

_INVENTORY = inventory_pb2.DESCRIPTOR.services_by_name["InventoryService"].full_name
_NODES = nodes_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name
_FABRIC = fabric_pb2.DESCRIPTOR.services_by_name["FabricService"].full_name
_AUDIT = audit_pb2.DESCRIPTOR.services_by_name["AuditService"].full_name
GUARDED_PREFIXES = tuple(f"/{name}/" for name in (_INVENTORY, _NODES, _FABRIC, _AUDIT))

OPERATOR = frozenset({Role.OPERATOR})
NODE_USERS = frozenset({Role.OPERATOR, Role.TENANT})


@dataclass(frozen=True)
class Rule:
    """Who may call one RPC.

    ``roles``: the roles allowed at all. ``agent_host``: for an agent, the host the
    request names (it must be the agent's own). ``tenant_named``: for a tenant, the
    tenant id the request names (empty names none; otherwise it must be the caller's
    own). ``operator_only``: a predicate on the request that makes this call an
    operator's alone, with ``operator_only_what`` saying what it is for the message.
    """

    roles: frozenset[Role]
    agent_host: Callable[[Any], str] | None = None
    tenant_named: Callable[[Any], str] | None = None
    operator_only: Callable[[Any], bool] | None = None
    operator_only_what: str = ""


def _host_id(name: str) -> str:
    return name.removeprefix("hosts/")


def _tenant_id(name: str) -> str:
    return name.removeprefix("tenants/")


def _gang_tenant(request: Any) -> str:
    """The tenant a ComposeGang request's members name: empty when none names one, the
    one they name, or, when they name several, all of them joined (which is no single
    caller's own, so a tenant caller is refused)."""
    named = sorted({str(spec.tenant) for spec in request.members if spec.tenant})
    return ",".join(named)


RULES: Mapping[str, Rule] = {
    # Inventory: the operator's.
    f"/{_INVENTORY}/CreateBox": Rule(OPERATOR),
    f"/{_INVENTORY}/GetBox": Rule(OPERATOR),
    f"/{_INVENTORY}/ListBoxes": Rule(OPERATOR),
    f"/{_INVENTORY}/CordonBox": Rule(OPERATOR),
    f"/{_INVENTORY}/UncordonBox": Rule(OPERATOR),
    f"/{_INVENTORY}/DeleteBox": Rule(OPERATOR),
    f"/{_INVENTORY}/GetGpu": Rule(OPERATOR),
    f"/{_INVENTORY}/ListGpus": Rule(OPERATOR),
    f"/{_INVENTORY}/ReclaimGpu": Rule(OPERATOR),
    f"/{_INVENTORY}/ClearGpuHealth": Rule(OPERATOR),
    f"/{_INVENTORY}/GetPoolStatus": Rule(OPERATOR),
    f"/{_INVENTORY}/ListHosts": Rule(OPERATOR),
    f"/{_INVENTORY}/CordonHost": Rule(OPERATOR),
    f"/{_INVENTORY}/UncordonHost": Rule(OPERATOR),
    f"/{_INVENTORY}/DrainHost": Rule(OPERATOR),
    f"/{_INVENTORY}/DrainBox": Rule(OPERATOR),
    # An agent may read its own host's record.
    f"/{_INVENTORY}/GetHost": Rule(
        frozenset({Role.OPERATOR, Role.AGENT}), agent_host=lambda r: _host_id(r.name)
    ),
    # Nodes: operators and tenants; NodeService scopes a tenant to its own nodes.
    # A tenant composes for itself only (spec.tenant empty or its own name).
    f"/{_NODES}/ComposeNode": Rule(NODE_USERS, tenant_named=lambda r: str(r.spec.tenant)),
    f"/{_NODES}/PlanNode": Rule(NODE_USERS, tenant_named=lambda r: str(r.spec.tenant)),
    f"/{_NODES}/GetNode": Rule(NODE_USERS),
    f"/{_NODES}/GetNodeHostdev": Rule(NODE_USERS),
    f"/{_NODES}/ListNodes": Rule(NODE_USERS),
    f"/{_NODES}/ReleaseNode": Rule(
        NODE_USERS, operator_only=lambda r: bool(r.force), operator_only_what="force release"
    ),
    f"/{_NODES}/WatchNodes": Rule(NODE_USERS),
    f"/{_NODES}/ResizeNode": Rule(NODE_USERS),
    # The queue: a tenant sees its own requests (NodeService scopes it), at their
    # positions in the whole queue.
    f"/{_NODES}/ListQueue": Rule(NODE_USERS, tenant_named=lambda r: str(r.tenant)),
    # Gangs: as their member nodes (a tenant's own only).
    f"/{_NODES}/ComposeGang": Rule(NODE_USERS, tenant_named=_gang_tenant),
    f"/{_NODES}/GetGang": Rule(NODE_USERS),
    f"/{_NODES}/ReleaseGang": Rule(
        NODE_USERS, operator_only=lambda r: bool(r.force), operator_only_what="force release"
    ),
    # Quotas: operators set and list them; a tenant may read its own.
    f"/{_NODES}/SetTenantQuota": Rule(OPERATOR),
    f"/{_NODES}/DeleteTenant": Rule(OPERATOR),
    f"/{_NODES}/GetTenant": Rule(NODE_USERS, tenant_named=lambda r: _tenant_id(r.name)),
    f"/{_NODES}/ListTenants": Rule(OPERATOR),
    # Latency between a host and a box: anyone placing work; an agent for its own host.
    f"/{_FABRIC}/GetLatency": Rule(frozenset(Role), agent_host=lambda r: _host_id(r.host)),
    f"/{_FABRIC}/Predict": Rule(frozenset(Role), agent_host=lambda r: _host_id(r.host)),
    # Who did what: the operator's.
    f"/{_AUDIT}/ListAuditRecords": Rule(OPERATOR),
}


def owner_scope(identity: Identity | None) -> str | None:
    """The owner a caller is limited to: a tenant's own identity URI; None (every node)
    for operators and when authentication is off."""
    if identity is not None and identity.role is Role.TENANT:
        return identity.uri
    return None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class TokenTable:
    """Bearer tokens and the identities they stand for.

    The file is YAML, a mapping ``TOKEN: ROLE/NAME`` (or ``dxpool://ROLE/NAME``); one that
    group or others may read is refused (keep it mode 0600). Lookups compare the SHA-256
    of the token with every entry's in constant time and look at every entry, so timing
    tells nothing about which token is close.
    """

    entries: tuple[tuple[bytes, Identity], ...] = field(default=())

    @classmethod
    def load(cls, path: Path) -> TokenTable:
        check_private(path, "token file", reason="INVALID_TOKEN_FILE")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as error:
            raise InvalidArgument(
                f"cannot read token file {path}: {error.strerror}", reason="INVALID_TOKEN_FILE"
            ) from None
        except yaml.YAMLError as error:
            raise InvalidArgument(
                f"token file {path} is not valid YAML: {error}", reason="INVALID_TOKEN_FILE"
            ) from None
        if not isinstance(data, dict) or not data:
            raise InvalidArgument(
                f"token file {path} must map tokens to identities, e.g. '3f9c...: tenant/team-a'",
                reason="INVALID_TOKEN_FILE",
            )
        entries = []
        for token, who in data.items():
            if not isinstance(token, str) or len(token) < 16:
                raise InvalidArgument(
                    f"token file {path}: every token must be a string of 16 characters or "
                    "more (e.g. `openssl rand -hex 32`)",
                    reason="INVALID_TOKEN_FILE",
                )
            if not isinstance(who, str):
                raise InvalidArgument(
                    f"token file {path}: identities are ROLE/NAME strings, got {who!r}",
                    reason="INVALID_TOKEN_FILE",
                )
            uri = who if who.startswith("dxpool://") else f"dxpool://{who}"
            entries.append((_digest(token), Identity.parse(uri)))
        return cls(tuple(entries))

    def lookup(self, token: str) -> Identity | None:
        wanted = _digest(token)
        found: Identity | None = None
        for digest, identity in self.entries:
            if hmac.compare_digest(digest, wanted):
                found = identity
        return found


@functools.lru_cache(maxsize=1024)
def _certificate_identity(pem: bytes) -> Identity | str:
    """The identity in a PEM client certificate, or why there is none (cached: a client
    presents the same certificate on every call of a connection)."""
    try:
        found = identities_in(x509.load_pem_x509_certificate(pem))
    except (ValueError, InvalidArgument) as error:
        return f"the client certificate's dxpool identity is malformed: {error}"
    if len(found) != 1:
        return (
            f"the client certificate carries {len(found)} dxpool identities; it needs "
            "exactly one SAN URI dxpool://ROLE/NAME (issue one with `dxpool certs issue`)"
        )
    return found[0]


@dataclass(frozen=True)
class Authenticator:
    """Finds who calls: by a bearer token from ``tokens``, or by the verified client
    certificate (when ``certificates``)."""

    tokens: TokenTable | None = None
    certificates: bool = True

    def identify(self, context: grpc.ServicerContext) -> Identity:
        """The caller; Unauthenticated saying how to authenticate when there is none."""
        if self.tokens is not None:
            for key, value in context.invocation_metadata():
                if key == "authorization":
                    return self._from_token(str(value))
        if self.certificates:
            pems = context.auth_context().get("x509_pem_cert")
            if pems:
                found = _certificate_identity(bytes(pems[0]))
                if isinstance(found, str):
                    raise Unauthenticated(found, reason="NO_IDENTITY")
                return found
        how = "a client certificate from the broker's client CA"
        if self.tokens is not None:
            how = "a bearer token (authorization: Bearer TOKEN)"
        raise Unauthenticated(
            f"this broker requires authentication: connect with {how}",
            reason="UNAUTHENTICATED",
        )

    def _from_token(self, value: str) -> Identity:
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated(
                "the authorization metadata must be 'Bearer TOKEN'", reason="BAD_TOKEN"
            )
        assert self.tokens is not None
        found = self.tokens.lookup(token.strip())
        if found is None:
            raise Unauthenticated(
                "the bearer token is not known to this broker; check --token-file",
                reason="BAD_TOKEN",
            )
        return found


def check(rule: Rule, identity: Identity, method: str, request: Any) -> None:
    """PermissionDenied unless ``identity`` may make this call."""
    rpc = method.rsplit("/", 1)[-1]
    if identity.role not in rule.roles:
        allowed = " or ".join(sorted(role.value for role in rule.roles))
        raise PermissionDenied(
            f"{rpc} needs the role {allowed}; {identity.uri} has the role {identity.role.value}",
            reason="ROLE_NOT_ALLOWED",
            metadata={"rpc": rpc, "role": identity.role.value},
        )
    if identity.role is Role.AGENT and rule.agent_host is not None:
        host = rule.agent_host(request)
        if host != identity.name:
            raise PermissionDenied(
                f"{rpc}: agent {identity.uri} may only name its own host hosts/"
                f"{identity.name}, not {host or 'no host'}",
                reason="NOT_OWN_HOST",
            )
    if identity.role is Role.TENANT and rule.tenant_named is not None:
        tenant = rule.tenant_named(request)
        if tenant and tenant != identity.name:
            raise PermissionDenied(
                f"{rpc}: tenant {identity.uri} may only name its own tenant "
                f"{identity.name}, not {tenant}",
                reason="NOT_OWN_TENANT",
                metadata={"rpc": rpc, "tenant": identity.name},
            )
    if (
        identity.role is not Role.OPERATOR
        and rule.operator_only is not None
        and rule.operator_only(request)
    ):
        raise PermissionDenied(
            f"{rpc}: {rule.operator_only_what} needs the role operator; {identity.uri} "
            f"has the role {identity.role.value}",
            reason="ROLE_NOT_ALLOWED",
            metadata={"rpc": rpc, "role": identity.role.value},
        )


class Authorizer(Interceptor):
    """Authenticates and authorizes every call to a dxpool service (see the module doc)."""

    def __init__(self, authenticator: Authenticator, rules: Mapping[str, Rule] = RULES) -> None:
        self.authenticator = authenticator
        self._rules = rules

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(details)
        method: str = details.method
        if handler is None or not method.startswith(GUARDED_PREFIXES):
            return handler
        rule = self._rules.get(method)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method, rule),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method, rule),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # dxpool serves no client-streaming RPCs

    def _admit(
        self, method: str, rule: Rule | None, request: Any, context: grpc.ServicerContext
    ) -> None:
        """Return if the call may go on; otherwise abort it with its status."""
        try:
            identity = self.authenticator.identify(context)
            if rule is None:  # a method the table forgot: deny, never allow by default
                raise PermissionDenied(
                    f"{method} is not in the broker's authorization table; no role may call it",
                    reason="ROLE_NOT_ALLOWED",
                )
            check(rule, identity, method, request)
        except DxpoolError as error:
            context.abort_with_status(to_status(error))

    def _unary(
        self, behavior: Callable[..., Any], method: str, rule: Rule | None
    ) -> Callable[[Any, grpc.ServicerContext], Any]:
        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            self._admit(method, rule, request, context)
            return behavior(request, context)

        return guarded

    def _stream(
        self, behavior: Callable[..., Iterator[Any]], method: str, rule: Rule | None
    ) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
        def guarded(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._admit(method, rule, request, context)
            return behavior(request, context)

        return guarded
