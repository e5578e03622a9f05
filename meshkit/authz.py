"""The mesh's one authorization table (which role may call which RPC on which resource) and its enforcement.

Every service installs the same interceptor. It establishes who calls (SPIFFE id of the peer's
certificate, or a client API key) and checks the table before the handler runs, so a refused call
changes nothing. Requests carried by a client stream (lease renewals, telemetry) are checked
message by message by the servicer through `Authorizer.check_message`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
from collections import Counter as Tally
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc
from google.rpc import status_pb2
from prometheus_client import CollectorRegistry, Counter

from meshkit.clock import Clock, SystemClock
from meshkit.errors import Reason, grpc_status_for, rpc_status_for
from meshkit.guards import CheckingInterceptor, Context
from meshkit.identity import ApiKeys, Identity, IdentityError, Role, bearer_token, identity_from_uris
from meshkit.limits import Oversized
from meshkit.logs import get_logger
from meshkit.tls import SecurityConfig

log = get_logger(module="meshkit.authz")

_ALL = frozenset(Role)


@dataclass(frozen=True)
class Rule:
    """Who may call one RPC, and which request fields must name the caller itself."""

    roles: frozenset[Role]
    pool_field: str = ""
    """A request field (dotted path) that must equal the calling relay's pool."""
    name_field: str = ""
    """A request field (dotted path) that must equal the caller's own name (relay id, frontend id)."""
    per_message: bool = False
    """A client stream: the servicer checks each request message with check_message()."""
    note: str = ""
    """Why, for SECURITY.md."""
    anonymous: bool = False
    """Callable without any credentials (an HTTP liveness probe); everything else needs an identity."""
    server_pool: bool = False
    """A relay caller's pool must be the pool the server serves (`Authorizer(pool=...)`); a server
    that does not know its pool refuses every relay (fail closed)."""


def _rule(
    *roles: Role,
    pool: str = "",
    name: str = "",
    stream: bool = False,
    note: str = "",
    anonymous: bool = False,
    server_pool: bool = False,
) -> Rule:
    return Rule(
        frozenset(roles),
        pool_field=pool,
        name_field=name,
        per_message=stream,
        note=note,
        anonymous=anonymous,
        server_pool=server_pool,
    )


HTTP = "HTTP "
"""Prefix of the HTTP front's entries: "HTTP /path" (exact paths; an unlisted path is 404 to callers
who identified themselves)."""


R, F, A, C = Role.RELAY, Role.FRONTEND, Role.ADMIN, Role.CLIENT

_D = "/globaldiscovery.v1.DiscoveryService/"
_T = "/poolrelay.v1.TelemetryService/"
_E = "/poolrelay.v1.PoolEventsService/"
_S = "/poolrelay.v1.RelayStatusService/"
_G = "/globalrouter.v1.RouterService/"
_P = "/globalrouter.v1.PoolFrontendService/"
_M = "/mocker.v1.MockerAdminService/"

TABLE: Mapping[str, Rule] = {
    # Global discovery.
    _D + "RegisterPool": _rule(R, pool="pool_id", name="relay_id", note="a relay of the pool, as itself"),
    _D + "KeepAlivePools": _rule(
        R, pool="register.pool_id", name="register.relay_id", stream=True, note="each renewal checked"
    ),
    _D + "UnregisterPool": _rule(R, pool="pool_id", name="relay_id", note="a relay of the pool, as itself"),
    _D + "DrainPool": _rule(A, note="operators only"),
    _D + "RemovePool": _rule(A, note="operators only"),
    _D + "RegisterFrontend": _rule(F, name="frontend_id", note="a frontend, as itself"),
    _D + "UnregisterFrontend": _rule(F, name="frontend_id", note="a frontend, as itself"),
    _D + "ListPools": _rule(R, F, A, C, note="the directory is readable by every identity"),
    _D + "WatchPools": _rule(F, A, C, note="frontends follow the directory"),
    _D + "ListFrontends": _rule(R, F, A, note="relays find the frontends to stream to"),
    # Global frontend.
    _G + "Generate": _rule(C, note="clients (certificate or API key)"),
    _G + "Route": _rule(C, note="clients (certificate or API key)"),
    _G + "ListPools": _rule(C, note="clients (certificate or API key)"),
    _T + "PublishPoolTelemetry": _rule(
        R, pool="hello.pool_id", name="hello.relay_id", stream=True, note="the hello names the caller's pool"
    ),
    # Pool side (mocker pool frontend, relay status).
    _P + "Generate": _rule(F, note="global frontends send work to pools"),
    _E + "WatchPoolStatus": _rule(R, server_pool=True, note="the pool's own relays read its state"),
    _E + "WatchKvEvents": _rule(R, server_pool=True, note="the pool's own relays read its state"),
    _E + "StartDrain": _rule(
        R, A, server_pool=True, note="the pool's own relay passes a discovery drain on; operators"
    ),
    _S + "GetRelayStatus": _rule(A, note="operators"),
    _M + "SetModelReady": _rule(A, note="operators (simulation control)"),
    _M + "SetFaults": _rule(A, note="operators (simulation control)"),
    _M + "GetWorkerBlocks": _rule(A, note="operators (simulation control)"),
    _M + "GetPoolStats": _rule(A, note="operators (simulation control)"),
    # The global frontend's OpenAI-compatible HTTP front (same identities, same table).
    HTTP + "/v1/models": _rule(C, note="clients (certificate or API key)"),
    HTTP + "/v1/completions": _rule(C, note="clients (certificate or API key)"),
    HTTP + "/v1/chat/completions": _rule(C, note="clients (certificate or API key)"),
    HTTP + "/": _rule(A, C, note="the status page: operators and clients (it shows what ListPools shows)"),
    HTTP + "/status.json": _rule(A, C, note="the status page's data"),
    HTTP + "/metrics": _rule(A, note="operators (Prometheus scrapes with an admin certificate)"),
    HTTP + "/health": _rule(*_ALL, anonymous=True, note="liveness probes: no credentials needed"),
    HTTP + "/livez": _rule(*_ALL, anonymous=True, note="liveness probes: no credentials needed"),
    HTTP + "/readyz": _rule(*_ALL, anonymous=True, note="readiness probes: no credentials needed"),
    # Standard services: any authenticated peer may ask whether a server is healthy, or what it serves.
    "/grpc.health.v1.Health/": _rule(*_ALL, note="any authenticated peer"),
    "/grpc.reflection.v1alpha.ServerReflection/": _rule(*_ALL, note="any authenticated peer"),
    "/grpc.reflection.v1.ServerReflection/": _rule(*_ALL, note="any authenticated peer"),
}
"""method (or "/service/" for all its methods) → rule. A method not listed is refused to everyone."""


KEYS_CHECK_SECONDS = 1.0
"""How often (at most) the --api-keys file is looked at for changes, when keys are presented."""


def _file_stamp(path: str) -> tuple[int, int, int] | None:
    """What changes when a file is replaced or rewritten (mtime, size, inode); None when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


async def _abort(context: Context, refusal: Refusal) -> None:
    """Ends another task's call: the client gets `refusal`, the handler's next read or write raises."""
    # abort raises in its caller once the status is sent; a call that ended meanwhile refuses it.
    with contextlib.suppress(Exception):
        await context.abort_with_status(refusal.status())


def rule_for(method: str) -> Rule | None:
    """The rule of a full method name (/package.Service/Method); None when it is not in the table."""
    rule = TABLE.get(method)
    if rule is None:
        rule = TABLE.get(method[: method.rfind("/") + 1])
    return rule


class Refusal(Exception):
    """A call that may not proceed: UNAUTHENTICATED (who?) or PERMISSION_DENIED (not you)."""

    def __init__(self, code: grpc.StatusCode, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason

    def rpc_status(self) -> status_pb2.Status:
        """As a google.rpc.Status (for replies that carry a status in a message)."""
        return rpc_status_for(self.code, self.reason, str(self))

    def status(self) -> grpc.Status:
        """As the grpc.Status a call aborts with."""
        return grpc_status_for(self.code, self.reason, str(self))


def _field(message: object, path: str) -> tuple[bool, str]:
    """(present, value) of a dotted field path; a path through an unset sub-message is not present."""
    parts = path.split(".")
    for part in parts[:-1]:
        if not message.HasField(part):  # type: ignore[attr-defined]
            return False, ""
        message = getattr(message, part)
    return True, str(getattr(message, parts[-1]))


def _denied(message: str) -> Refusal:
    return Refusal(grpc.StatusCode.PERMISSION_DENIED, Reason.NOT_AUTHORIZED, message)


def decide(
    identity: Identity, method: str, request: object | None = None, server_pool: str = ""
) -> Refusal | None:
    """Whether `identity` may call `method` (with `request` when its fields matter) on a server of
    pool `server_pool` ("": a server of no pool, or one that does not know it). Pure."""
    rule = rule_for(method)
    if rule is None:
        return _denied(f"{method} is not callable")
    if identity.role not in rule.roles:
        return _denied(f"{identity} may not call {method} (allowed: {', '.join(sorted(rule.roles))})")
    if rule.server_pool and identity.role == Role.RELAY and identity.pool != server_pool:
        if not server_pool:
            return _denied(f"{identity} may not call {method}: this server does not know its pool")
        return _denied(f"{identity} may not call {method} of pool {server_pool!r}: not its pool")
    if request is None:
        return None
    # (field path, the caller's own value, what a mismatch means)
    owned = (
        (rule.pool_field, identity.pool, "may not act for pool {value!r} ({path})"),
        (rule.name_field, identity.name, "may act only as itself, not as {value!r} ({path})"),
    )
    for path, own, complaint in owned:
        if not path:
            continue
        present, value = _field(request, path)
        if present and value != own:
            return _denied(f"{identity} " + complaint.format(value=value, path=path))
    return None


UNCHECKED = Identity(role=Role.ADMIN, name="local", source="unchecked")
"""The caller of a server that enforces nothing (no TLS, no API keys: loopback development)."""

_current: contextvars.ContextVar[Identity] = contextvars.ContextVar("mesh_identity", default=UNCHECKED)


def current_identity() -> Identity:
    """The caller of the RPC being handled (UNCHECKED when the server enforces nothing)."""
    return _current.get()


class Authorizer:
    """Identifies callers and applies TABLE for one server; counts what it refuses."""

    def __init__(
        self,
        config: SecurityConfig,
        service: str,
        *,
        registry: CollectorRegistry | None = None,
        pool: str = "",
        clock: Clock | None = None,
    ) -> None:
        self.enforced = config.enforced
        self.pool = pool
        """The pool this server serves, for rules with `server_pool` ("" for servers of no pool)."""
        self.trust_domain = config.trust_domain
        self.service = service
        self.api_keys_path = config.api_keys
        self._clock = clock or SystemClock()
        self._keys_stamp = _file_stamp(config.api_keys) if config.api_keys else None
        self._keys_checked = self._clock.monotonic()
        self.api_keys = ApiKeys.load(config.api_keys) if config.api_keys else ApiKeys()
        """The keys in force: replaced whole by reload_api_keys(), so a call sees the old or the new set."""
        self.refused: Tally[tuple[str, str]] = Tally()
        """(method, reason) → refusals, for tests and status pages."""
        self.metrics_registry = registry or CollectorRegistry()
        self._refusals = Counter(
            "mesh_auth_refusals",
            "Calls refused by authentication or authorization",
            ["service", "method", "code"],
            registry=self.metrics_registry,
        )
        self._hooks: dict[str, list[Callable[[Refusal], None]]] = {}
        self._aborting: set[asyncio.Task[None]] = set()
        self._keyed: dict[str, dict[Context, str]] = {}
        """API key digest → the calls it opened that are still open (→ their method): a reload that
        revokes the key ends them. Bounded by the server's open calls."""

    def on_refusal(self, method: str, hook: Callable[[Refusal], None]) -> None:
        """Calls `hook(refusal)` for each refusal of `method` (after it is counted and logged)."""
        self._hooks.setdefault(method, []).append(hook)

    def reload_api_keys(self) -> bool:
        """Re-reads the --api-keys file (SIGHUP): every call from now on is checked against the new
        keys. Logs the identities added, removed and re-keyed (never a key). A file that cannot be
        read or has a bad line is refused with a log line naming it, and the current keys stay.
        Returns whether new keys are in force."""
        if not self.api_keys_path:
            return False
        self._keys_stamp = _file_stamp(self.api_keys_path)
        try:
            fresh = ApiKeys.load(self.api_keys_path)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            log.error(
                "API keys NOT reloaded: the file is refused, the current keys stay in force",
                service=self.service,
                path=self.api_keys_path,
                error=str(exc),
                kept=len(self.api_keys),
            )
            return False
        old, new = self.api_keys.identities(), fresh.identities()
        self.api_keys = fresh
        cut = self._end_revoked_calls()
        log.info(
            "API keys reloaded",
            service=self.service,
            path=self.api_keys_path,
            keys=len(fresh),
            added=sorted(new.keys() - old.keys()),
            removed=sorted(old.keys() - new.keys()),
            rekeyed=sorted(who for who in new.keys() & old.keys() if new[who] != old[who]),
            open_calls_ended=cut,
        )
        return True

    def _watch_keys(self) -> None:
        """Reloads the keys when their file changed on disk (looked at once per KEYS_CHECK_SECONDS,
        when a key is presented): a revocation written to the file needs no SIGHUP."""
        now = self._clock.monotonic()
        if now - self._keys_checked < KEYS_CHECK_SECONDS:
            return
        self._keys_checked = now
        if _file_stamp(self.api_keys_path) != self._keys_stamp:
            self.reload_api_keys()

    def key_in_force(self, identity: Identity) -> bool:
        """Whether `identity` may still act: always for a certificate, while its key is in force for a key."""
        return not identity.key or identity.key in self.api_keys

    def _hold(self, identity: Identity, method: str, context: Context) -> None:
        """Remembers a call opened with an API key until it ends (a revoked key's calls are ended)."""
        calls = self._keyed.setdefault(identity.key, {})
        calls[context] = method

        def release(_context: Context) -> None:
            calls.pop(context, None)
            if not calls and self._keyed.get(identity.key) is calls:
                del self._keyed[identity.key]

        context.add_done_callback(release)  # type: ignore[arg-type]  # the stubs want a class, grpc takes any callable

    def _end_revoked_calls(self) -> int:
        """Ends with UNAUTHENTICATED every open call made with a key no longer in force; how many."""
        revoked = [digest for digest in self._keyed if digest not in self.api_keys]
        calls = [
            (context, method) for digest in revoked for context, method in self._keyed.pop(digest).items()
        ]
        if not calls:
            return 0
        loop = asyncio.get_running_loop()  # open calls exist only on the server's loop (SIGHUP runs there)
        for context, method in calls:
            refusal = Refusal(
                grpc.StatusCode.UNAUTHENTICATED, Reason.UNAUTHENTICATED, "the API key was revoked"
            )
            self.record(method, refusal)
            task = loop.create_task(_abort(context, refusal))
            self._aborting.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._aborting.discard)
        return len(calls)

    def identify(self, context: Context) -> Identity:
        """Who is calling: the certificate's SPIFFE id, else a client API key. Raises Refusal."""
        if not self.enforced:
            return UNCHECKED
        uris = [u.decode(errors="replace") for u in context.auth_context().get("peer_uri", [])]
        authorization = next(
            (v for k, v in context.invocation_metadata() or () if k == "authorization"), None
        )
        return self.identify_peer(uris, authorization if isinstance(authorization, str | None) else "")

    def identify_peer(self, uris: list[str], authorization: str | None) -> Identity:
        """Who is calling, from a verified peer certificate's URI SANs or an `authorization` value
        (gRPC metadata or HTTP header). Raises Refusal."""
        if not self.enforced:
            return UNCHECKED
        if uris:
            try:
                return identity_from_uris(uris, self.trust_domain)
            except IdentityError as exc:
                raise Refusal(grpc.StatusCode.UNAUTHENTICATED, Reason.UNAUTHENTICATED, str(exc)) from exc
        if authorization is not None:
            if self.api_keys_path:
                self._watch_keys()
            token = bearer_token(authorization)
            who = self.api_keys.identify(token) if token else None
            if who is None:
                raise Refusal(
                    grpc.StatusCode.UNAUTHENTICATED, Reason.UNAUTHENTICATED, "the API key is not valid"
                )
            return who
        raise Refusal(
            grpc.StatusCode.UNAUTHENTICATED,
            Reason.UNAUTHENTICATED,
            "no identity: present a mesh certificate or an `authorization: Bearer` API key",
        )

    def record(self, method: str, refusal: Refusal) -> None:
        """Counts and logs a refusal."""
        self.refused[(method, str(refusal.reason))] += 1
        label = method.rsplit("/", 1)[-1] if method.startswith("/") else method  # HTTP: "HTTP /path"
        self._refusals.labels(self.service, label, refusal.code.name).inc()
        log.info(
            "call refused", service=self.service, method=method, code=refusal.code.name, why=str(refusal)
        )
        for hook in self._hooks.get(method, ()):
            hook(refusal)

    def admit(self, context: Context, method: str, request: object | None) -> Identity:
        """The caller, when it may call `method` with `request`; raises Refusal (already counted)."""
        try:
            identity = self.identify(context)
            if self.enforced:
                refusal = decide(identity, method, request, self.pool)
                if refusal is not None:
                    raise refusal
        except Refusal as refusal:
            self.record(method, refusal)
            raise
        return identity

    def admit_http(self, path: str, uris: list[str], authorization: str | None) -> Identity:
        """The caller of an HTTP request for `path`, when TABLE lets it call that path; raises
        Refusal (already counted). Paths without an entry need only an identity (they are 404)."""
        method = HTTP + path
        rule = TABLE.get(method)
        if not self.enforced or (rule is not None and rule.anonymous):
            return UNCHECKED
        try:
            identity = self.identify_peer(uris, authorization)
            if rule is not None:
                refusal = decide(identity, method)
                if refusal is not None:
                    raise refusal
        except Refusal as refusal:
            self.record(method, refusal)
            raise
        return identity

    def check_message(self, method: str, request: object) -> Refusal | None:
        """For a client stream's servicer: may the stream's caller send this message? (None: yes; counted when no.)"""
        if not self.enforced:
            return None
        refusal = decide(current_identity(), method, request, self.pool)
        if refusal is not None:
            self.record(method, refusal)
        return refusal

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """The server interceptor that identifies the caller and applies TABLE before every handler."""

        async def check(method: str, request: object | None, context: Context) -> None:
            if type(request) is Oversized:
                # Not decoded (over its cap as received): it has no fields to check, the caller
                # and its role are; the size check after this one refuses it.
                request = None
            try:
                identity = self.admit(context, method, request)
            except Refusal as refusal:
                await context.abort_with_status(refusal.status())
            _current.set(identity)
            if identity.key:
                self._hold(identity, method, context)

        return CheckingInterceptor(check, applies=lambda _method: self.enforced)
