"""The pool directory as this frontend knows it: kept from discovery's WatchPools, never emptied by an outage."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Literal

import grpc
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential_jitter

from globaldiscovery.v1 import discovery_pb2, discovery_pb2_grpc
from globalrouter.pool_state import PoolCapacityHint, PoolState
from meshkit.clock import Clock
from meshkit.logs import get_logger

log = get_logger(module="globalrouter.pool_directory")

EventType = discovery_pb2.WatchEventType

TELEMETRY_LIVE_WITHIN = 5.0
"""Seconds within which a pool's telemetry must have spoken here for it to count as live evidence
that the pool is alive (the lease grace), at the least: five of a relay's default 1 s reports and
heartbeats. A relay that announces a longer report interval gets LIVE_REPORTS of its own (see
live_within_for). A stream that stays open but silent (a wedged relay) stops counting after this."""
LIVE_REPORTS = 5
"""A relay's telemetry counts as live while it spoke within this many of its report intervals."""
MAX_TELEMETRY_LIVE_WITHIN = 60.0
"""The longest silence that still counts as live, whatever interval a relay announces (outside
input): older telemetry is no evidence the relay is alive."""
GRACE_SWEEP_S = 0.5
"""How often pools in lease grace are checked (their telemetry may stop before the grace ends)."""

GraceOutcome = Literal["kept", "dropped", "reregistered", "expired", "telemetry_stopped", "removed"]
"""What happened to a pool whose lease lapsed (the lease grace; PoolTable.lapse):
kept: its telemetry is live here, so it stays routable for one lease duration;
dropped: no live telemetry, it left at once (as every lapsed pool did before the grace);
reregistered: listed again within the grace; expired: the grace ended with no registration;
telemetry_stopped: its telemetry stopped (or went silent) within the grace;
removed: discovery removed it for another reason (RemovePool, UnregisterPool, drain) within the grace."""


class PoolTable:
    """Every pool this frontend knows, listed by discovery or only heard of over telemetry.

    The directory watch writes the directory fields; telemetry writes the signal fields. A pool
    that leaves the directory is kept while telemetry streams still describe it (listed=False), so
    a re-listing finds its KV state intact.
    """

    def __init__(self, *, live_within: float = TELEMETRY_LIVE_WITHIN) -> None:
        if not 0 < live_within <= MAX_TELEMETRY_LIVE_WITHIN:
            raise ValueError(
                f"live_within must be > 0 and at most {MAX_TELEMETRY_LIVE_WITHIN:g} seconds; got {live_within!r}"
            )
        self.pools: dict[str, PoolState] = {}
        self.lease_incarnations: dict[str, dict[str, int]] = {}
        """pool_id -> relay_id -> incarnation of that relay's live lease (from the directory)."""
        self.synced = False
        """True once a watch snapshot has been taken (the directory is then known)."""
        self.complete = False
        """Discovery's own completeness flag of the last snapshot."""
        self.stream_counts: dict[str, int] = {}
        """pool_id -> telemetry streams open for it (maintained by telemetry ingestion)."""
        self.telemetry_heard: Callable[[str], float | None] | None = None
        """pool_id -> clock time this frontend last heard a message on one of the pool's open
        telemetry streams (TelemetryIngest.last_heard; None: no ingest, so never live)."""
        self.telemetry_interval: Callable[[str], float] | None = None
        """pool_id -> the longest gap between messages the pool's open telemetry streams announce
        (TelemetryIngest.report_interval: a relay's hello.report_interval, or this frontend's batch
        interval when longer; 0 when none announces one). None: every relay taken as reporting
        within `live_within` / LIVE_REPORTS."""
        self.live_within = live_within
        """The liveness bound of a pool whose relays report at least every `live_within` /
        LIVE_REPORTS seconds (see live_within_for)."""
        self.lease_grace: dict[str, float] = {}
        """pool_id -> clock time its lease grace ends (listed although its leases lapsed; see lapse)."""
        self.on_grace: Callable[[GraceOutcome], None] | None = None
        """Told each lease-grace outcome (the frontend counts them)."""

    def get(self, pool_id: str) -> PoolState:
        """The pool's state, created (unlisted) when unknown."""
        pool = self.pools.get(pool_id)
        if pool is None:
            pool = self.pools[pool_id] = PoolState(pool_id=pool_id)
        return pool

    def listed(self) -> list[PoolState]:
        """The pools discovery lists (the only ones selection considers)."""
        return [p for p in self.pools.values() if p.listed]

    def forget_if_unused(self, pool_id: str) -> None:
        """Drops a pool that is neither listed nor described by any telemetry stream."""
        pool = self.pools.get(pool_id)
        if pool is not None and not pool.listed and not self.stream_counts.get(pool_id):
            del self.pools[pool_id]

    # ---- directory events -----------------------------------------------------------------
    def apply_listed(self, msg: discovery_pb2.Pool) -> PoolState:
        """A pool is listed (ADDED/UPDATED): its directory fields take the message's values."""
        pool = self.get(msg.pool_id)
        pool.listed = True
        pool.model = msg.model
        pool.region = msg.region
        pool.frontends = tuple(msg.frontends)
        pool.openai_http = msg.frontend_protocol == discovery_pb2.FRONTEND_PROTOCOL_OPENAI_HTTP
        pool.directory_draining = msg.draining
        cap = msg.capacity
        pool.capacity = PoolCapacityHint(
            max_running_requests=cap.max_running_requests,
            kv_cache_blocks=cap.kv_cache_blocks,
            prefill_tokens_per_second=cap.prefill_tokens_per_second,
        )
        self.lease_incarnations[msg.pool_id] = {lease.relay_id: lease.incarnation for lease in msg.leases}
        if self._end_grace(pool):
            self._told("reregistered")
        return pool

    def apply_removed(self, pool_id: str, outcome: GraceOutcome = "removed") -> None:
        """A pool left the directory: it is no longer routed to (a pool in lease grace too)."""
        pool = self.pools.get(pool_id)
        self.lease_incarnations.pop(pool_id, None)
        if pool is None:
            return
        if self._end_grace(pool):
            self._told(outcome)
        pool.listed = False
        pool.directory_draining = False
        self.forget_if_unused(pool_id)

    # ---- the lease grace ------------------------------------------------------------------
    def telemetry_live(self, pool_id: str, now: float) -> bool:
        """Whether one of the pool's telemetry streams to this frontend is open and has spoken
        within live_within_for(pool_id): direct evidence that the pool's relay is alive."""
        if not self.stream_counts.get(pool_id) or self.telemetry_heard is None:
            return False
        heard = self.telemetry_heard(pool_id)
        return heard is not None and now - heard <= self.live_within_for(pool_id)

    def live_within_for(self, pool_id: str) -> float:
        """How recently the pool's telemetry must have spoken to count as live: LIVE_REPORTS of the
        longest report interval its open streams announce, never less than `live_within` (a relay
        reporting every second or faster keeps today's bound) nor more than
        MAX_TELEMETRY_LIVE_WITHIN. Why: a relay configured to report every 2 s or more would
        otherwise often be silent longer than a fixed 5 s between two reports, and get no grace."""
        interval = self.telemetry_interval(pool_id) if self.telemetry_interval is not None else 0.0
        return min(max(self.live_within, LIVE_REPORTS * interval), MAX_TELEMETRY_LIVE_WITHIN)

    def lapse(self, pool_id: str, now: float, grace: float) -> bool:
        """Discovery dropped the pool because its lease(s) expired. A listed pool whose telemetry is
        live here stays routable until `now + grace` (one lease duration: the time its relay needs
        to register again once discovery answers) and True is returned; any other leaves at once.

        Why: leases lapse when every discovery replica is down although the relays are alive and
        retrying; dropping their pools then turns losing signals into a routing outage. Membership
        still changes by lease expiry: this frontend only defers acting on it while it has direct
        evidence the pool is alive, and for one lease at most (a grace already running keeps its
        end: repeated lapses never extend it)."""
        pool = self.pools.get(pool_id)
        if pool is None or not pool.listed:
            return False
        if pool_id in self.lease_grace:
            return True
        if grace <= 0 or not self.telemetry_live(pool_id, now):
            self.apply_removed(pool_id)
            self._told("dropped")
            return False
        self.lease_grace[pool_id] = pool.lease_grace_until = now + grace
        self._told("kept")
        log.info("lease lapsed, telemetry live: the pool stays routable", pool_id=pool_id, grace_s=grace)
        return True

    def sweep_grace(self, now: float) -> list[str]:
        """Ends the lease grace of pools whose grace is over or whose telemetry stopped (they leave
        the directory, as they would have when their lease lapsed); the pools that left."""
        gone: list[tuple[str, GraceOutcome]] = []
        for pool_id, until in self.lease_grace.items():
            if now >= until:
                gone.append((pool_id, "expired"))
            elif not self.telemetry_live(pool_id, now):
                gone.append((pool_id, "telemetry_stopped"))
        for pool_id, outcome in gone:
            log.info("lease grace over: the pool leaves", pool_id=pool_id, why=outcome)
            self.apply_removed(pool_id, outcome)
        return [pool_id for pool_id, _ in gone]

    def next_grace_end(self) -> float | None:
        """When the earliest lease grace ends (None: no pool is in grace)."""
        return min(self.lease_grace.values(), default=None)

    def _end_grace(self, pool: PoolState) -> bool:
        if self.lease_grace.pop(pool.pool_id, None) is None:
            return False
        pool.lease_grace_until = None
        return True

    def _told(self, outcome: GraceOutcome) -> None:
        if self.on_grace is not None:
            self.on_grace(outcome)

    def replace_directory(
        self,
        listed: Iterable[discovery_pb2.Pool],
        complete: bool,
        *,
        now: float = 0.0,
        grace: float = 0.0,
    ) -> None:
        """A new watch's snapshot is the truth: pools it does not list are unlisted.

        An incomplete snapshot (a fresh discovery replica that has not heard every heartbeat yet)
        only adds and updates: a pool it misses may just not have renewed there yet, and losing
        signals never deletes a pool. The watcher re-watches later for a complete one. A complete
        snapshot does not say why a pool is missing: with `grace` (the watcher gives it to every
        re-sync, e.g. after a broken watch, when every discovery replica may have been down and
        leases lapsed meanwhile) a missing pool is taken as lapsed (`lapse`), so one whose
        telemetry is live here stays routable one grace; without, it is unlisted at once.
        """
        seen: set[str] = set()
        for msg in listed:
            self.apply_listed(msg)
            seen.add(msg.pool_id)
        if complete:
            gone = [p for p, s in self.pools.items() if s.listed and p not in seen]
            for pool_id in gone:
                if grace > 0:
                    self.lapse(pool_id, now, grace)
                else:
                    self.apply_removed(pool_id)
        self.synced = True
        self.complete = complete

    def lease_incarnation(self, pool_id: str, relay_id: str) -> int:
        """The incarnation the directory lists for (pool, relay); 0 when none."""
        return self.lease_incarnations.get(pool_id, {}).get(relay_id, 0)


class WatchEnded(Exception):
    """The watch stream ended without an error (the server closed it): watch again."""


# Reconnect to discovery after a broken watch: quickly at first, then every few seconds, forever
# (the frontend keeps routing on the directory it has meanwhile).
WATCH_RECONNECT_WAIT = wait_exponential_jitter(multiplier=0.2, max=3.0, jitter=0.3)


class DirectoryWatcher:
    """Keeps a PoolTable in step with discovery's WatchPools; re-watches with back-off when it breaks.

    A pool discovery drops because its leases expired (a REMOVED event of reason LEASE_EXPIRED, or
    a complete re-sync snapshot that misses it) gets the table's lease grace (PoolTable.lapse) of
    one lease duration, which this watcher also ends on time (sweep_grace)."""

    def __init__(
        self,
        table: PoolTable,
        channel: grpc.aio.Channel,
        clock: Clock,
        on_change=None,
        lease_duration: Callable[[], float] = lambda: 15.0,
    ) -> None:
        self._table = table
        self._stub = discovery_pb2_grpc.DiscoveryServiceStub(channel)
        self._clock = clock
        self._on_change = on_change
        self._lease_duration = lease_duration
        """The lease duration discovery dictates: how long a fresh replica's snapshot may be
        incomplete (re-watch after it), and the lease grace."""
        self.watches_started = 0
        self.connected = asyncio.Event()
        """Set while a watch is in step with discovery (after its snapshot)."""
        self._synced_this_watch = False
        self._resync: asyncio.Timeout | None = None
        self._grace_pending = asyncio.Event()
        """Set when a pool entered the lease grace (the sweeper then watches the table's graces)."""
        self.last_revision = 0
        """Discovery's revision of the last event applied; a re-watch resumes after it."""
        self._want_snapshot = True
        """Set while the next watch must take a snapshot (no sync yet, or a re-sync is due)."""
        self.resumes = 0
        """Watches that resumed (no snapshot) rather than starting from one."""

    async def run(self) -> None:
        """Watches, and ends lease graces on time, until cancelled."""
        tasks = {
            asyncio.ensure_future(self._watch_forever()),
            asyncio.ensure_future(self._sweep_forever()),
        }
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a failure (a bug: both run forever) as itself, for the supervisor
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch_forever(self) -> None:
        while True:
            async for attempt in AsyncRetrying(
                wait=WATCH_RECONNECT_WAIT,
                retry=retry_if_exception_type((grpc.aio.AioRpcError, WatchEnded)),
                sleep=self._clock.sleep,
                reraise=True,
            ):
                with attempt:
                    await self._watch_once()

    async def _sweep_forever(self) -> None:
        """Ends each lease grace when it is over or its pool's telemetry stops (checked every
        GRACE_SWEEP_S while some pool is in grace; idle otherwise)."""
        while True:
            end = self._table.next_grace_end()
            if end is None:
                self._grace_pending.clear()
                await self._grace_pending.wait()
                continue
            await self._clock.sleep(min(GRACE_SWEEP_S, max(0.0, end - self._clock.monotonic())))
            if self._table.sweep_grace(self._clock.monotonic()):
                self._changed()

    async def _watch_once(self) -> None:
        """One watch. Returns normally when it ended after a snapshot (re-watch at once); raises
        when it broke before one (re-watch after a back-off)."""
        self.watches_started += 1
        self._synced_this_watch = False
        start = 0 if self._want_snapshot else self.last_revision
        call = self._stub.WatchPools(discovery_pb2.WatchPoolsRequest(start_revision=start))
        try:
            async with asyncio.timeout(None) as self._resync:
                await self._follow(call)
        except TimeoutError:
            # The snapshot was incomplete: watch again for a complete one (nothing is lost, the
            # new snapshot carries every pool's current state).
            log.info("re-watching for a complete directory snapshot")
            return
        except grpc.aio.AioRpcError as exc:
            log.warning("directory watch broken; routing on the directory we have", code=exc.code().name)
            if not self._synced_this_watch:
                raise
            return
        finally:
            call.cancel()
            self.connected.clear()
        if not self._synced_this_watch:
            raise WatchEnded("watch ended before its snapshot")

    async def _follow(self, call) -> None:
        snapshot: list[discovery_pb2.Pool] = []
        async for event in call:
            if not self._synced_this_watch:
                if event.type == EventType.WATCH_EVENT_TYPE_SNAPSHOT_DONE and event.resumed:
                    # Discovery still had every change after our revision: they follow, no snapshot.
                    self._synced_this_watch = True
                    self.resumes += 1
                    self.connected.set()
                    log.info("directory watch resumed", revision=event.revision)
                    continue
                if event.type == EventType.WATCH_EVENT_TYPE_SNAPSHOT_DONE:
                    # A snapshot (first watch, or a reset): its revision is the one to resume from.
                    self.last_revision = event.revision
                    # A re-sync (the table was synced before) may miss pools whose leases lapsed
                    # while every discovery replica was down: they get the lease grace.
                    grace = self._lease_duration() if self._table.synced else 0.0
                    self._table.replace_directory(
                        snapshot, event.complete, now=self._clock.monotonic(), grace=grace
                    )
                    self._synced_this_watch = True
                    self.connected.set()
                    log.info("directory snapshot", pools=len(snapshot), complete=event.complete)
                    # An incomplete snapshot needs a complete one a lease later.
                    self._want_snapshot = not event.complete
                    if self._want_snapshot and self._resync is not None:
                        self._resync.reschedule(asyncio.get_running_loop().time() + self._lease_duration())
                    self._changed()
                elif event.type == EventType.WATCH_EVENT_TYPE_ADDED:
                    snapshot.append(event.pool)
                continue
            if event.revision and event.revision <= self.last_revision:
                continue  # already applied (a replay overlapping what we had): never twice
            if event.revision:
                self.last_revision = event.revision
            if event.type in (EventType.WATCH_EVENT_TYPE_ADDED, EventType.WATCH_EVENT_TYPE_UPDATED):
                self._table.apply_listed(event.pool)
            elif event.type == EventType.WATCH_EVENT_TYPE_REMOVED:
                log.info("pool removed", pool_id=event.pool.pool_id, reason=event.removal_reason)
                if event.removal_reason == discovery_pb2.REMOVAL_REASON_LEASE_EXPIRED:
                    # Decided on the machine-readable reason: only a lapse gets the grace; an
                    # operator's removal, an unregistration and a completed drain act at once.
                    self._table.lapse(event.pool.pool_id, self._clock.monotonic(), self._lease_duration())
                else:
                    self._table.apply_removed(event.pool.pool_id)
            self._changed()

    def _changed(self) -> None:
        if self._table.lease_grace:
            self._grace_pending.set()
        if self._on_change is not None:
            self._on_change()
