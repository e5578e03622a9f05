"""The etcd store: state shared by any number of discovery replicas; etcd's own leases carry expiry.

What a write may do is decided by lease_rules on the records read from etcd (the same rules the
in-memory store applies). Every write goes to etcd; each replica keeps a mirror (a Directory that never expires anything
itself) fed by one etcd watch, and answers listings and watchers from it. A lease lapses when
etcd ends it: the key's DELETE reaches every replica's mirror, and so every watcher. A call
returns only after this replica's mirror has seen its own write, so a reply shows the write.

Watch revisions are etcd's: each pool event carries the etcd revision of the change that made it,
which every replica sees alike, so a watch seen to revision R on one replica resumes exactly on
another (WatchPoolsRequest.start_revision). A replica that has not applied R yet waits for it
(bounded); one whose history starts after R (it started or re-read etcd later) reads the changes
before it from etcd's history; when etcd compacted them (or there are more than the history
holds) the watch gets a reset snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import math
from collections.abc import Callable
from dataclasses import asdict

import aetcd
import aetcd.exceptions
import grpc
from aetcd import rpc
from aetcd.transactions import Mod
from aetcd.utils import prefix_range_end
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from globaldiscovery import lease_rules
from globaldiscovery.lease_rules import NotFound
from globaldiscovery.lease_state import DEFAULT_HISTORY_BYTES, DEFAULT_QUEUE_BYTES, Directory
from globaldiscovery.records import (
    Capacity,
    FrontendView,
    PoolEvent,
    PoolRegistration,
    PoolView,
    RegisterResult,
    Removal,
)
from globaldiscovery.store.base import StoreIsolated, StoreUnavailable
from globaldiscovery.store.etcd_link import DEFAULT_ISOLATION_TIMEOUT, EtcdLink, LinkChange
from globaldiscovery.store.expiry import Expiry
from globaldiscovery.watch_fanout import Watcher, WatcherClosed
from meshkit import discovery_endpoints
from meshkit.clock import Clock
from meshkit.logs import get_logger

log = get_logger(module="globaldiscovery.store.etcd")

PREFIX = b"/globaldiscovery/v1/"
LEASES = PREFIX + b"lease/"  # lease/<pool>\0<relay> -> registration JSON (on an etcd lease)
DRAINS = PREFIX + b"drain/"  # drain/<pool> -> {"deadline_wall": ...}
DRAINED = PREFIX + b"drained/"  # drained/<pool>\0<relay> -> highest refused incarnation
FRONTENDS = PREFIX + b"frontend/"  # frontend/<id> -> frontend JSON (on an etcd lease)
SEP = b"\x00"  # ids never hold control characters, so this cannot be part of one
MIRROR_LEASE = 10 * 365 * 86_400.0  # the mirror never expires a lease itself: etcd does
CATCH_UP_SECONDS = 10.0
# How long a resumed watch waits for this replica to apply the revision it resumes from (another
# replica was ahead); then it gets a reset snapshot rather than a delta that would miss changes.
RESUME_CATCH_UP_SECONDS = 5.0
# Re-sync after the etcd watch broke: quickly at first, then at most every 5 s.
ETCD_RESYNC = wait_exponential_jitter(multiplier=0.2, max=5.0, jitter=0.2)
# Ending a completed drain's leases in etcd: every replica tries, each a few times.
DRAIN_WRITE_STOP = stop_after_attempt(5)
DRAIN_WRITE_WAIT = wait_exponential_jitter(multiplier=0.2, max=2.0, jitter=0.2)
# A registration whose pool changed between its read and its write is decided again, a few times
# (the jitter spreads replicas that keep colliding); then the caller is told to retry.
REGISTER_ATTEMPTS = 8
REGISTER_STOP = stop_after_attempt(REGISTER_ATTEMPTS)
REGISTER_WAIT = wait_exponential_jitter(multiplier=0.005, max=0.2, jitter=0.02)


class _Contended(Exception):
    """The keys a registration was decided on changed before its write (another replica wrote)."""


def _mod_of_range(start: bytes, end: bytes) -> Mod:
    """A compare on the mod revision of every key in [start, end) (etcd holds it for each key)."""
    return Mod(start, range_end=end)


def _unavailable(method):
    """Turns etcd client errors into StoreUnavailable (UNAVAILABLE for the caller)."""

    @functools.wraps(method)
    async def wrapper(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except (aetcd.exceptions.ClientError, grpc.RpcError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"etcd did not answer: {exc}") from exc

    return wrapper


def _lease_key(pool_id: str, relay_id: str) -> bytes:
    return LEASES + pool_id.encode() + SEP + relay_id.encode()


def _encode(reg: PoolRegistration, lease_id: int, end_reason: Removal | None = None) -> bytes:
    record = asdict(reg)
    record["lease_id"] = lease_id
    record["end_reason"] = end_reason.value if end_reason is not None else None
    return json.dumps(record, separators=(",", ":")).encode()


def _decode(value: bytes) -> tuple[PoolRegistration, int, Removal | None]:
    record = json.loads(value)
    lease_id = record.pop("lease_id")
    end_reason = record.pop("end_reason")
    record["frontends"] = tuple(record["frontends"])
    record["capabilities"] = tuple(record["capabilities"])
    if record["capacity"] is not None:
        record["capacity"] = Capacity(**record["capacity"])
    return PoolRegistration(**record), lease_id, Removal(end_reason) if end_reason is not None else None


def _readable(kvs) -> list[PoolRegistration]:
    """The registrations among `kvs` that decode; one unreadable record is logged, never fatal."""
    out = []
    for kv in kvs:
        try:
            out.append(_decode(kv.value)[0])
        except Exception:
            log.warning("unreadable lease record in etcd; ignored", key=kv.key)
    return out


def _drained_reason(known: dict[bytes, bytes], pool_id: str, relay_id: str, incarnation: int) -> Removal:
    """Why a lease deleted without a stated reason ended: DRAINED when a completed drain refused
    its incarnation (written before the deletion, so every replica reads it alike)."""
    refused = known.get(DRAINED + pool_id.encode() + SEP + relay_id.encode())
    with contextlib.suppress(ValueError):
        if refused is not None and incarnation <= int(refused):
            return Removal.DRAINED
    return Removal.LEASE_EXPIRED


def _apply_pool_record(
    directory: Directory,
    known: dict[bytes, bytes],
    kind: str,
    key: bytes,
    value: bytes,
    prev: bytes | None,
    now: float,
) -> None:
    """Applies one etcd change to a mirror `directory` and `known` (every key as last seen):
    leases and drains change pools; other keys are only remembered."""
    if kind == "PUT":
        known[key] = value
    else:
        prev = prev if prev is not None else known.get(key)
        known.pop(key, None)
    if key.startswith(LEASES):
        if kind == "PUT":
            reg, _, _ = _decode(value)
            directory.register_pool(reg, now, trusted=True)
        else:
            pool_id, relay_id = (part.decode() for part in key[len(LEASES) :].split(SEP, 1))
            reason = Removal.LEASE_EXPIRED
            if prev is not None:
                with contextlib.suppress(Exception):  # an unreadable record still leaves
                    ended, _, stated = _decode(prev)
                    reason = stated or _drained_reason(known, pool_id, relay_id, ended.incarnation)
            directory.unregister_pool(pool_id, relay_id, 2**64, reason, now)
    elif key.startswith(DRAINS) and kind == "PUT":
        pool_id = key[len(DRAINS) :].decode()
        deadline_wall = json.loads(value)["deadline_wall"]
        with contextlib.suppress(NotFound):
            directory.drain_pool(pool_id, deadline_wall - directory.wall(now), now)


def _records_first(kvs) -> list:
    """`kvs` with every lease before any drain, so a drain finds its pool."""
    return sorted(kvs, key=lambda kv: not kv.key.startswith(LEASES))


class EtcdStore:
    """The directory shared through etcd; listings are complete at once."""

    def __init__(
        self,
        clock: Clock,
        *,
        endpoint: str,
        heartbeat_interval: float,
        lease_duration: float,
        watch_queue_limit: int = 10_000,
        watch_queue_bytes: int = DEFAULT_QUEUE_BYTES,
        watch_history_limit: int = 10_000,
        watch_history_bytes: int = DEFAULT_HISTORY_BYTES,
        isolation_timeout: float = DEFAULT_ISOLATION_TIMEOUT,
    ) -> None:
        self.clock = clock
        # One endpoint or several ("A,B,C", the members of an etcd cluster): one channel that
        # spreads calls over the members and skips one that died, so losing a member fails only
        # the calls that were on it (retried by the relays) and the mirror's watch (re-synced).
        endpoints = discovery_endpoints.parse_endpoints(endpoint)
        host, _, port = discovery_endpoints.channel_target(endpoints)[0].rpartition(":")
        self._client = aetcd.Client(
            host=host, port=int(port), options=dict(discovery_endpoints.channel_options(endpoints))
        )
        self.heartbeat_interval = heartbeat_interval
        # etcd leases last whole seconds (and at least 2); the relays are told the real figure.
        self._ttl = max(2, math.ceil(lease_duration))
        self.lease_duration = float(self._ttl)
        now = clock.monotonic()
        self.directory = Directory(
            MIRROR_LEASE,
            started_at=now,
            wall_offset=clock.wall() - now,
            watch_queue_limit=watch_queue_limit,
            watch_queue_bytes=watch_queue_bytes,
            watch_history_limit=watch_history_limit,
            watch_history_bytes=watch_history_bytes,
            complete_at_start=True,
            on_drained=self._drain_completed,
            mirror=True,
        )
        self._expiry = Expiry(self.directory, clock)
        self._frontends: dict[str, FrontendView] = {}
        self._frontends_version = 0
        self._applied = 0  # the etcd revision the mirror has applied
        self._compacted = False  # etcd no longer has the changes after _applied: re-read everything
        self._catch_up_to = 0
        """After a resumed watch: the revision of the newest change under the prefix when it was
        opened; the mirror counts as following etcd (and the replica serves) once it applied that."""
        self._advanced = asyncio.Event()
        self._follower: asyncio.Task[None] | None = None
        self._watch = None
        self._background: set[asyncio.Task] = set()
        self._known: dict[bytes, bytes] = {}  # every key the mirror holds, as last seen
        self.link = EtcdLink(isolation_timeout, now)
        self._prober: asyncio.Task[None] | None = None
        self._health_listeners: list[Callable[[bool], None]] = []

    # ----- lifecycle and the mirror -----

    @_unavailable
    async def start(self) -> None:
        await self._client.connect()
        await self._sync()
        self.link.followed(self.clock.monotonic())
        self._follower = asyncio.create_task(self._follow_forever(), name="etcd-follow")
        self._prober = asyncio.create_task(self._watch_link(), name="etcd-link")
        self._expiry.start()

    def on_health(self, listener: Callable[[bool], None]) -> None:
        self._health_listeners.append(listener)

    def _refuse_if_isolated(self) -> None:
        """Raises StoreIsolated while this replica is cut off from etcd: its mirror is frozen, so
        neither a write (it cannot reach etcd) nor a read (it would be stale) is answered here."""
        if self.link.isolated:
            silent = self.link.silent_for(self.clock.monotonic())
            raise StoreIsolated(
                f"this discovery replica has not reached etcd for {silent:.1f} s "
                f"(limit {self.link.timeout:g} s); call another replica"
            )

    async def _watch_link(self) -> None:
        """Asks etcd a few times per isolation timeout whether it is there (a watch with no
        changes says nothing), and acts when the link is lost or regained."""
        while True:
            await self.clock.sleep(self.link.probe_interval)
            try:
                async with asyncio.timeout(self.link.probe_interval):
                    await self._etcd_revision()
                self.link.contact(self.clock.monotonic())
            except (TimeoutError, aetcd.exceptions.ClientError, grpc.RpcError, OSError):
                pass  # silence: the check below counts it
            change = self.link.check(self.clock.monotonic())
            if change is LinkChange.LOST:
                log.warning(
                    "etcd unreachable; this replica stops serving (NOT_SERVING, watches ended) until it re-syncs",
                    silent_s=round(self.link.silent_for(self.clock.monotonic()), 2),
                    isolation_timeout_s=self.link.timeout,
                    applied_revision=self._applied,
                )
                self.directory.close_watchers(WatcherClosed.ISOLATED)
                self._tell(serving=False)
                await self._restart_follower()
            elif change is LinkChange.REGAINED:
                log.info("etcd reachable again; mirror re-synced, serving", applied_revision=self._applied)
                self._tell(serving=True)

    def _tell(self, *, serving: bool) -> None:
        for listener in self._health_listeners:
            try:
                listener(serving)
            except Exception:  # one listener must not keep the others from hearing it
                log.exception("a health listener failed")

    async def _restart_follower(self) -> None:
        """Drops the mirror's etcd watch (it may hang on a dead link) and follows etcd afresh:
        the replica serves again only once its mirror re-synced (link.followed)."""
        old, watch = self._follower, self._watch
        if old is not None:
            old.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await old
        if watch is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await watch.cancel()
        self._watch = None
        self._follower = asyncio.create_task(self._follow_forever(), name="etcd-follow")

    async def _sync(self) -> None:
        """Starts following etcd. After a broken watch, from the change after the last one applied
        (etcd's history: exact, so watches and their history go on); at start, or when etcd has
        compacted those changes away, by making the mirror equal to etcd now."""
        if self._applied and not self._compacted:
            if await self._etcd_revision() >= self._applied:
                # The watch replays what was missed as events: until they are applied the mirror
                # is behind, so the replica serves again only once it reached the newest change
                # there is now (a missed delete past that is applied a moment later).
                self._catch_up_to = await self._newest_change()
                self._watch = await self._client.watch_prefix(
                    PREFIX, start_revision=self._applied + 1, prev_kv=True
                )
                return
            # Its revision went back: another etcd (re-created empty, restored from a backup).
            # Watching from our revision would wait for changes that never come: re-read it.
            log.warning("etcd's revision is behind the mirror's; re-reading etcd", applied=self._applied)
        snapshot = await self._client.get_prefix(PREFIX)
        if self._applied:
            # The changes in between are lost: a watcher cannot go on change by change (it
            # re-watches and resumes on a replica that has them, or gets a snapshot).
            self.directory.close_watchers(WatcherClosed.RESYNC)
        if snapshot.header.revision < self._applied:
            self.directory.rewind(snapshot.header.revision)
            self._applied = snapshot.header.revision
        self.directory.at_revision(snapshot.header.revision)
        present = {kv.key for kv in snapshot}
        for key in [k for k in self._known if k not in present]:
            self._apply_safely("DELETE", key, b"", self._known[key])  # ended while we were not watching
        for kv in _records_first(snapshot):
            if self._known.get(kv.key) != kv.value:
                self._apply_safely("PUT", kv.key, kv.value, None)
        self.directory.reset_history()  # those events were a diff, not etcd's changes
        self._applied = max(self._applied, snapshot.header.revision)
        self._catch_up_to = 0  # the snapshot is applied: nothing to catch up
        self._compacted = False
        self._advanced.set()
        self._watch = await self._client.watch_prefix(
            PREFIX, start_revision=snapshot.header.revision + 1, prev_kv=True
        )

    async def _follow_forever(self) -> None:
        """Follows the watch; when it breaks (etcd restarted, network), re-syncs with back-off."""
        while True:
            async for attempt in AsyncRetrying(wait=ETCD_RESYNC, retry=retry_if_exception_type(Exception)):
                with attempt:
                    try:
                        if self._watch is None:
                            await self._sync()
                            self._mark_following()
                        await self._follow()
                    except aetcd.exceptions.RevisionCompactedError:
                        self._compacted = True
                        raise
                    finally:
                        self._watch = None
                        self.link.broke()
            log.warning("etcd watch ended; re-syncing")

    async def close(self) -> None:
        self.directory.close_watchers()
        await self._expiry.stop()
        for task in [self._prober, self._follower, *self._background]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._watch is not None:
            with contextlib.suppress(Exception):
                await self._watch.cancel()
        with contextlib.suppress(Exception):
            await self._client.close()

    async def _follow(self) -> None:
        async for event in self._watch:  # type: ignore[attr-defined]  # set by _sync() before _follow()
            prev = event.prev_kv.value if event.prev_kv is not None else None
            self.directory.at_revision(event.kv.mod_revision)  # the revision its pool event carries
            self._apply_safely(event.kind, event.kv.key, event.kv.value, prev)
            self._applied = max(self._applied, event.kv.mod_revision)
            self._advanced.set()
            self.link.contact(self.clock.monotonic())
            if not self.link.following:
                self._mark_following()

    def _mark_following(self) -> None:
        """Marks the mirror as following etcd once it applied what a resumed watch had to replay."""
        if self._applied >= self._catch_up_to:
            self.link.followed(self.clock.monotonic())

    async def _newest_change(self) -> int:
        """The mod revision of the newest key under the prefix (0 when there is none): one key read."""
        reply = await self._client.kvstub.Range(
            rpc.RangeRequest(
                key=PREFIX,
                range_end=prefix_range_end(PREFIX),
                limit=1,
                sort_order=rpc.RangeRequest.DESCEND,
                sort_target=rpc.RangeRequest.MOD,
                keys_only=True,
            ),
            metadata=self._client.metadata,
        )
        return max((kv.mod_revision for kv in reply.kvs), default=0)

    def _apply_safely(self, kind: str, key: bytes, value: bytes, prev: bytes | None) -> None:
        """_apply, logging instead of raising: one bad record must not stop the mirror or its start."""
        try:
            self._apply(kind, key, value, prev)
        except Exception:
            log.exception("cannot apply an etcd record; skipped", key=key, kind=kind)

    def _apply(self, kind: str, key: bytes, value: bytes, prev: bytes | None) -> None:
        _apply_pool_record(self.directory, self._known, kind, key, value, prev, self.clock.monotonic())
        if key.startswith(FRONTENDS):
            frontend_id = key[len(FRONTENDS) :].decode()
            if kind == "PUT":
                record = json.loads(value)
                record.pop("lease_id", None)
                self._frontends[frontend_id] = FrontendView(**record)
            else:
                self._frontends.pop(frontend_id, None)
            self._frontends_version += 1
        self._expiry.poke()

    async def _caught_up(self, revision: int) -> None:
        """Waits until the mirror has applied `revision` (this replica's own write)."""
        deadline = self.clock.monotonic() + CATCH_UP_SECONDS
        while self._applied < revision:
            self._advanced.clear()
            left = deadline - self.clock.monotonic()
            if left <= 0:
                raise StoreUnavailable("the etcd watch fell behind")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._advanced.wait(), left)

    def _drain_completed(self, pool_id: str, refused: list[tuple[str, int]]) -> None:
        """The mirror ended a drain: record the refusals and end the leases in etcd (every replica may)."""
        task = asyncio.get_running_loop().create_task(self._write_drained(pool_id, refused))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _write_drained(self, pool_id: str, refused: list[tuple[str, int]]) -> None:
        """Records the refused incarnations, then deletes the leases: their deletions remove the
        pool (reason DRAINED) from every mirror at the same etcd revisions."""
        try:
            async for attempt in AsyncRetrying(stop=DRAIN_WRITE_STOP, wait=DRAIN_WRITE_WAIT, reraise=True):
                with attempt:
                    for relay_id, incarnation in refused:
                        await self._client.put(
                            DRAINED + pool_id.encode() + SEP + relay_id.encode(), str(incarnation).encode()
                        )
                        await self._client.delete(_lease_key(pool_id, relay_id))
                    await self._client.delete(DRAINS + pool_id.encode())
        except Exception as exc:
            log.warning("cannot record a completed drain in etcd", pool_id=pool_id, error=repr(exc))

    # ----- etcd leases -----

    async def _lease_for(self, lease_id: int | None) -> int:
        """Renews etcd lease `lease_id` when it is still alive, else grants a new one."""
        if lease_id:
            reply = await self._client.refresh_lease(lease_id)
            if reply.TTL > 0:
                return lease_id
        return (await self._client.lease(self._ttl)).id

    # ----- pools -----

    @_unavailable
    async def register_pool(self, reg: PoolRegistration) -> RegisterResult:
        self._refuse_if_isolated()
        # Read, decide, write as one step: the write commits only if nothing it was decided on
        # changed (another replica registering into the same pool); else it is decided again.
        try:
            async for attempt in AsyncRetrying(
                stop=REGISTER_STOP,
                wait=REGISTER_WAIT,
                retry=retry_if_exception_type(_Contended),
                reraise=True,
            ):
                with attempt:
                    expire_wall, revision = await self._register_once(reg)
        except _Contended as exc:
            raise StoreUnavailable(
                f"pool {reg.pool_id!r} kept changing concurrently ({REGISTER_ATTEMPTS} tries); retry"
            ) from exc
        await self._caught_up(revision)
        now = self.clock.monotonic()
        view = self.directory.get_pool(reg.pool_id, now)
        if view is None:  # it left the directory while it registered (removed, drained)
            raise NotFound(reg.pool_id)
        drain_wall = self.directory.drain_deadline_wall(reg.pool_id)
        return RegisterResult(
            lease_expire_wall=expire_wall,
            pool=view,
            drain_requested=drain_wall is not None,
            drain_deadline_wall=drain_wall,
        )

    async def _register_once(self, reg: PoolRegistration) -> tuple[float, int]:
        """One read-decide-write of a registration: (the lease's expiry, the write's revision).
        Raises _Contended when the pool changed between the read and the write."""
        key = _lease_key(reg.pool_id, reg.relay_id)
        drained_key = DRAINED + reg.pool_id.encode() + SEP + reg.relay_id.encode()
        pool_start = LEASES + reg.pool_id.encode() + SEP
        pool_end = prefix_range_end(pool_start)
        # One read of everything the decision uses, all at one etcd revision.
        read = await self._client.kvstub.Txn(
            rpc.TxnRequest(
                success=[
                    rpc.RequestOp(request_range=rpc.RangeRequest(key=drained_key)),
                    rpc.RequestOp(request_range=rpc.RangeRequest(key=pool_start, range_end=pool_end)),
                ]
            ),
            timeout=self.link.timeout,  # longer means this replica is losing etcd: the caller retries
            metadata=self._client.metadata,
        )
        seen_at = read.header.revision
        drained_kvs = read.responses[0].response_range.kvs
        pool_kvs = read.responses[1].response_range.kvs
        lease_rules.check_not_drained(reg, int(drained_kvs[0].value) if drained_kvs else None)
        current = next((kv for kv in pool_kvs if kv.key == key), None)
        held = _decode(current.value) if current is not None else None
        lease_rules.check_incarnation(
            (reg.pool_id, reg.relay_id), held[0].incarnation if held is not None else None, reg.incarnation
        )
        holder = lease_rules.conflicting_holder(reg, _readable(pool_kvs))
        if holder is not None:
            if held is not None:  # the refusal shows the ended lease, as every reply shows its write
                await self._caught_up(await self._end(key, held[0], held[1], Removal.UNREGISTERED))
            raise lease_rules.ModelConflict(holder)
        # Taken before etcd renews the lease, so etcd's own expiry is never earlier than this.
        expire_wall = self.clock.wall() + self._ttl
        lease_id = await self._lease_for(held[1] if held is not None else None)
        stored = dataclasses.replace(reg, expire_wall=expire_wall)
        t = self._client.transactions
        ok, responses = await self._client.transaction(
            compare=[
                # Own lease: still the one read (not ended, not renewed by a newer relay).
                t.mod(key) == (current.mod_revision if current is not None else 0),
                # No lease of the pool written since the read (a new relay's, through another
                # replica: the check above would have refused it), and no drain refusal either.
                # A deletion (a lease ending) cannot make a refusal wrong, so it is not compared.
                _mod_of_range(pool_start, pool_end) < seen_at + 1,
                t.mod(drained_key) < seen_at + 1,
            ],
            success=[t.put(key, _encode(stored, lease_id), lease=lease_id)],
            failure=[],
        )
        if not ok:
            raise _Contended()
        return expire_wall, responses[0].response_put.header.revision

    async def _end(self, key: bytes, reg: PoolRegistration, lease_id: int, reason: Removal) -> int:
        """Marks why a lease ends (so every mirror reports it), then deletes it; returns the revision."""
        await self._client.put(key, _encode(reg, lease_id, reason), lease=lease_id)
        reply = await self._client.delete(key)
        return reply.header.revision if reply is not None else 0

    @_unavailable
    async def unregister_pool(self, pool_id: str, relay_id: str, incarnation: int, reason: Removal) -> bool:
        self._refuse_if_isolated()
        key = _lease_key(pool_id, relay_id)
        current = await self._client.get(key)
        if current is None:
            return False
        reg, lease_id, _ = _decode(current.value)
        lease_rules.check_incarnation((pool_id, relay_id), reg.incarnation, incarnation)
        await self._caught_up(await self._end(key, reg, lease_id, reason))
        return self.directory.get_pool(pool_id, self.clock.monotonic()) is None

    async def _read_your_writes(self) -> None:
        """Waits until the mirror has applied the newest discovery record etcd holds now (written
        through any replica): an operator action right after a registration that another replica
        answered must find the pool, not a mirror a moment behind. The newest record's revision,
        not etcd's own: that one also counts writes outside discovery's prefix (the frontends'
        budgets may share the etcd), which the mirror never sees. A deletion newer than every
        record is not waited for: the action then sees the pool as a moment earlier."""
        await self._caught_up(await self._newest_change())

    @_unavailable
    async def remove_pool(self, pool_id: str) -> PoolView:
        self._refuse_if_isolated()
        await self._read_your_writes()
        view = self.directory.get_pool(pool_id, self.clock.monotonic())
        lease_rules.require_listed(pool_id, view)
        assert view is not None
        revision = 0
        for kv in await self._client.get_prefix(LEASES + pool_id.encode() + SEP):
            reg, lease_id, _ = _decode(kv.value)
            revision = await self._end(kv.key, reg, lease_id, Removal.REMOVED)
        await self._client.delete(DRAINS + pool_id.encode())
        await self._caught_up(revision)
        return view

    @_unavailable
    async def drain_pool(self, pool_id: str, timeout: float) -> PoolView:  # noqa: ASYNC109 (a drain length)
        self._refuse_if_isolated()
        await self._read_your_writes()
        lease_rules.require_listed(pool_id, self.directory.get_pool(pool_id, self.clock.monotonic()))
        key = DRAINS + pool_id.encode()
        body = json.dumps(
            {"deadline_wall": lease_rules.drain_deadline(None, self.clock.wall(), timeout)}
        ).encode()
        # lease_rules.drain_deadline keeps an earlier deadline; in etcd that is "write only if absent".
        ok, _ = await self._client.transaction(
            compare=[self._client.transactions.version(key) == 0],
            success=[self._client.transactions.put(key, body)],
            failure=[],
        )
        if ok:
            current = await self._client.get(key)
            await self._caught_up(current.mod_revision)
        view = self.directory.get_pool(pool_id, self.clock.monotonic())
        lease_rules.require_listed(pool_id, view)
        assert view is not None
        return view

    async def list_pools(
        self, *, model: str, region: str, after: str | None, limit: int
    ) -> tuple[list[PoolView], bool, bool]:
        self._refuse_if_isolated()
        pools, more = self.directory.list_pools(
            self.clock.monotonic(), model=model, region=region, after=after, limit=limit
        )
        return pools, more, True

    async def watch(self, *, model: str, region: str, start_revision: int = 0) -> Watcher:
        self._refuse_if_isolated()
        if start_revision > 0 and not model and not region:
            if start_revision > self._applied:
                await self._reach(start_revision)
            elif start_revision < self.directory.history_floor:
                resumed = await self._resume_from_etcd(start_revision)
                if resumed is not None:
                    return resumed
        return self.directory.watch(
            self.clock.monotonic(), model=model, region=region, start_revision=start_revision
        )

    async def _reach(self, revision: int) -> None:
        """Waits (bounded) until the mirror has applied `revision`, which another replica sent; it
        returns at once when etcd itself has not reached it (not a revision of this etcd). Never
        raises: a watch that cannot resume gets a snapshot."""
        try:
            async with asyncio.timeout(RESUME_CATCH_UP_SECONDS):
                if revision > await self._etcd_revision():
                    return
                while self._applied < revision:
                    self._advanced.clear()
                    await self._advanced.wait()
        except (TimeoutError, aetcd.exceptions.ClientError, OSError) as exc:
            log.info(
                "a resumed watch did not catch up; it gets a snapshot", revision=revision, error=repr(exc)
            )

    async def _etcd_revision(self) -> int:
        """etcd's current revision (the header of a read of no key)."""
        return (await self._client.get_prefix(PREFIX + b"revision-probe/")).header.revision

    async def _resume_from_etcd(self, revision: int) -> Watcher | None:
        """A watcher resumed after `revision`, from before this replica's history (it started, or
        re-read etcd, after it): the changes up to its history are read from etcd's own history.
        None (the caller sends a snapshot) when etcd compacted them, there are more than the
        history holds, or etcd does not answer in time."""
        joined_at = self.directory.history_floor
        if joined_at - revision > self.directory.history_limit:
            return None
        try:
            async with asyncio.timeout(RESUME_CATCH_UP_SECONDS):
                earlier = await self._etcd_events(revision, joined_at)
        except (TimeoutError, aetcd.exceptions.ClientError, grpc.RpcError, OSError) as exc:
            log.info("cannot read a resumed watch's changes from etcd", revision=revision, error=repr(exc))
            return None
        if earlier is None:
            return None
        return self.directory.watch_joined(self.clock.monotonic(), earlier, revision, joined_at)

    async def _etcd_events(self, revision: int, upto: int) -> list[PoolEvent] | None:
        """The pool events of etcd's changes after `revision` up to `upto`, as a mirror that read
        etcd at `revision` and then followed it would have made them (a scratch mirror does)."""
        now = self.clock.monotonic()
        scratch = Directory(
            MIRROR_LEASE,
            started_at=now,
            wall_offset=self.clock.wall() - now,
            watch_history_limit=self.directory.history_limit,
            watch_history_bytes=self.directory.history_byte_limit,
            complete_at_start=True,
            mirror=True,
        )
        known: dict[bytes, bytes] = {}
        past = await self._client.kvstub.Range(
            rpc.RangeRequest(key=PREFIX, range_end=prefix_range_end(PREFIX), revision=revision),
            metadata=self._client.metadata,
        )
        scratch.at_revision(revision)
        for kv in _records_first(past.kvs):
            _apply_pool_record(scratch, known, "PUT", kv.key, kv.value, None, now)
        scratch.reset_history()
        # Every key, not only discovery's: some change happened at `upto` (a revision is a
        # write), so its arrival says every change up to it has (etcd sends them in order).
        # Each discovery write is one key, so no second discovery change shares that revision.
        changes = await self._client.watch(b"\0", range_end=b"\0", start_revision=revision + 1, prev_kv=True)
        try:
            async for event in changes:
                at = event.kv.mod_revision
                if at > upto:
                    break
                if event.kv.key.startswith(PREFIX):
                    scratch.at_revision(at)
                    prev = event.prev_kv.value if event.prev_kv is not None else None
                    _apply_pool_record(scratch, known, event.kind, event.kv.key, event.kv.value, prev, now)
                if at == upto:
                    break
        finally:
            with contextlib.suppress(Exception):
                await changes.cancel()
        return scratch.history_between(revision, upto)

    def unwatch(self, watcher: Watcher) -> None:
        self.directory.unwatch(watcher)

    # ----- frontends -----

    @_unavailable
    async def register_frontend(
        self, frontend_id: str, url: str, region: str, incarnation: int
    ) -> FrontendView:
        self._refuse_if_isolated()
        key = FRONTENDS + frontend_id.encode()
        current = await self._client.get(key)
        lease_id = None
        if current is not None:
            record = json.loads(current.value)
            lease_rules.check_incarnation(frontend_id, record["incarnation"], incarnation)
            lease_id = record.pop("lease_id", None)
        expire_wall = self.clock.wall() + self._ttl  # before the renewal: never later than etcd's
        lease_id = await self._lease_for(lease_id)
        view = FrontendView(
            frontend_id=frontend_id,
            url=url,
            region=region,
            incarnation=incarnation,
            expire_wall=expire_wall,
        )
        body = json.dumps({**asdict(view), "lease_id": lease_id}).encode()
        reply = await self._client.put(key, body, lease=lease_id)
        await self._caught_up(reply.header.revision)
        return view

    @_unavailable
    async def unregister_frontend(self, frontend_id: str, incarnation: int) -> bool:
        self._refuse_if_isolated()
        key = FRONTENDS + frontend_id.encode()
        current = await self._client.get(key)
        if current is None:
            return False
        lease_rules.check_incarnation(frontend_id, json.loads(current.value)["incarnation"], incarnation)
        reply = await self._client.delete(key)
        if reply is not None:
            await self._caught_up(reply.header.revision)
        return True

    def frontends_version(self) -> object:
        return self._frontends_version

    async def list_frontends(self) -> tuple[list[FrontendView], bool]:
        self._refuse_if_isolated()
        return sorted(self._frontends.values(), key=lambda f: f.frontend_id), True
