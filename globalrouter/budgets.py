"""Tenant budgets that hold over any window, across frontend replicas: tokens per minute and per day, requests per minute.

A limit of L seconds (`minute_seconds`, `day_seconds`) is counted in k buckets of b = L / k
seconds (`[budget] buckets`, 10 by default) aligned to the wall clock: bucket j covers
[j * b, (j + 1) * b), so every frontend agrees on which bucket a moment belongs to. One shared
record per (tenant, limit) holds, per bucket, how much of the limit frontends *reserved* in that
bucket. A frontend reserves in chunks (the policy's chunk_fraction of the limit) and only while
the sum over the current bucket and the k before it (the horizon, k + 1 buckets) stays within
the limit; it spends from its own chunk without asking anyone, but only during the bucket the
chunk was reserved in. At the first request of a later bucket it moves what is left of the chunk
into the new bucket in the same store step that reserves more, so an allowance never spends
outside its bucket and a bucket's count only grows while it is the current bucket.

The bound (tokens counted at admission, prompt + what was generated): **in every interval of L
seconds, wherever it starts, the fleet admits at most the limit** (no chunk on top). Any such
interval meets at most k + 1 buckets; the last reservation made in them checked their sum
against the limit, later buckets were empty then, and counts only shrink afterwards (unused
allowance moved on or given back). The price of the bucket rounding: a tenant spending at a
steady rate gets k / (k + 1) of its limit per window (10/11 with 10 buckets); a burst may still
use the whole limit at once. This assumes the frontends' clocks agree to well under a bucket
(NTP); a frontend ahead of the others only makes the sum larger (entries ahead of a frontend's
own bucket are counted), never smaller.

Chunks cost nothing against the bound, only underspend: at most one chunk per frontend reserved
and unused at a time (up to k + 1 buckets' worth for a frontend that died: a bucket's count
drops out of the sum when the bucket leaves the horizon, (k + 1) * b after it began, the moment
no interval of L seconds holding it can include the present). The record lives in the store
(etcd for a fleet, memory for a lone frontend), so a restarted frontend finds what was spent
before it; a frontend that stops gives its unused allowance back. Store writes stay amortised:
one per chunk, plus one per bucket in which a (tenant, limit) is used on a frontend.

Tokens: a request reserves prompt + max_tokens at admission and gives back what it did not
generate when it ends (`Ticket.settle`): into the frontend's allowance while that is still of the
request's bucket, else as a decrement of the request's bucket sent with the next store step.

`BudgetLedger` is the pure core (bucket arithmetic, chunk accounting, what to ask the store) on
times passed in; `TenantBudgets` drives it over a `BudgetStore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Protocol

from globalrouter.policy import BudgetSettings, TenantPolicy
from meshkit.clock import Clock
from meshkit.logs import get_logger

log = get_logger(module="globalrouter.budgets")

MAX_ALLOWANCES = 100_000
"""Allowances (tenant x limit) kept before those whose buckets left the horizon are dropped."""
MAX_RECORD_TEXT = 16_384
"""Bytes of a stored record at most (k + 1 buckets of at most MAX_BUCKETS): more is corrupt."""
_NEVER = -(2**62)
"""The bucket of an allowance that never reserved (before every horizon)."""


class Kind(StrEnum):
    """One limit of a tenant (the names are the policy keys)."""

    TOKENS_PER_MINUTE = "tokens_per_minute"
    TOKENS_PER_DAY = "tokens_per_day"
    REQUESTS_PER_MINUTE = "requests_per_minute"

    @property
    def tokens(self) -> bool:
        return self in _TOKEN_KINDS


_TOKEN_KINDS = frozenset({Kind.TOKENS_PER_MINUTE, Kind.TOKENS_PER_DAY})


def window_length(kind: Kind, settings: BudgetSettings) -> float:
    return settings.day_seconds if kind is Kind.TOKENS_PER_DAY else settings.minute_seconds


def bucket_at(wall: float, length: float, buckets: int) -> int:
    """The index of the bucket (of a window of `length` seconds cut in `buckets`) holding `wall`."""
    return math.floor(wall * buckets / length)


@functools.lru_cache(maxsize=4096)
def limits_of(policy: TenantPolicy) -> tuple[tuple[Kind, int], ...]:
    """The limits that apply (those above 0); looked up once per policy entry."""
    return tuple((k, getattr(policy, k.value)) for k in Kind if getattr(policy, k.value) > 0)


def apply_step(
    counts: Mapping[int, int], bucket: int, first: int, ask: int, limit: int, returns: Mapping[int, int]
) -> tuple[int, dict[int, int]]:
    """One store step on a record (reservations per bucket), the same for every store: forgets
    buckets before `first` (out of the horizon), takes returns[b] off bucket b (not below 0), then
    adds to `bucket` up to `ask`, never taking the sum of what is left past `limit`.
    Returns (granted, the record after)."""
    out = {b: c for b, c in counts.items() if b >= first}
    for b, amount in returns.items():
        if b in out:
            out[b] = max(0, out[b] - amount)
    granted = max(0, min(ask, limit - sum(out.values())))
    if granted:
        out[bucket] = out.get(bucket, 0) + granted
    return granted, {b: c for b, c in out.items() if c > 0}


def encode_record(counts: Mapping[int, int]) -> bytes:
    """A record as stored: `bucket:count` pairs, comma-separated, oldest first."""
    return ",".join(f"{b}:{c}" for b, c in sorted(counts.items())).encode()


def decode_record(raw: bytes) -> dict[int, int]:
    """The record `encode_record` wrote; ValueError naming what is wrong otherwise."""
    if len(raw) > MAX_RECORD_TEXT:
        raise ValueError(f"budget record of {len(raw)} bytes (at most {MAX_RECORD_TEXT})")
    out: dict[int, int] = {}
    text = raw.decode("ascii", errors="replace")
    for part in filter(None, text.split(",")):
        bucket, sep, count = part.partition(":")
        try:
            b, c = int(bucket), int(count)
        except ValueError:
            b, c, sep = 0, -1, ""
        if not sep or c < 0:
            raise ValueError(f"budget record entry {part[:40]!r} is not BUCKET:COUNT")
        out[b] = c
    return out


class BudgetStore(Protocol):
    """The shared records: per (tenant, limit), how much frontends reserved in each bucket."""

    async def reserve(
        self,
        key: str,
        bucket: int,
        first: int,
        ask: int,
        limit: int,
        returns: Mapping[int, int],
        expires_wall: float,
    ) -> tuple[int, dict[int, int]]:
        """`apply_step` on record `key`, atomically; returns (granted, the record after). The record
        may be forgotten after `expires_wall` (when `bucket` leaves the horizon)."""
        ...

    async def close(self) -> None: ...


class StoreError(Exception):
    """The budget store did not answer; the request is refused UNAVAILABLE (fail closed)."""


@dataclass(slots=True)
class _Allowance:
    """This frontend's reservation for one (tenant, limit), and the shared record as last seen."""

    key: str
    length: float
    """The window's length in seconds."""
    span: int
    """Buckets per window (k); the horizon is k + 1 buckets."""
    bucket: int = _NEVER
    """The bucket `available` was reserved in (or moved to): it can be spent only during it."""
    available: int = 0
    """Reserved in `bucket` and not spent by this frontend."""
    seen: dict[int, int] = field(default_factory=dict)
    """The shared record as last seen: every frontend's reservations per bucket."""
    returns: dict[int, int] = field(default_factory=dict)
    """Refunds of requests of past buckets, to take off those buckets at the next store step."""
    view_first: int = _NEVER
    view_used: int = 0
    view_newest: int = _NEVER
    """`seen` summed over the horizon starting at view_first, and its newest bucket with some:
    kept until the horizon moves or `seen` changes (the headers of every admission read them)."""

    def view(self, first: int) -> tuple[int, int]:
        """(reserved in the horizon starting at `first`, its newest bucket with some or _NEVER), as last seen."""
        if self.view_first != first:
            live = [b for b, c in self.seen.items() if b >= first and c > 0]
            self.view_first = first
            self.view_used = sum(self.seen[b] for b in live)
            self.view_newest = max(live, default=_NEVER)
        return self.view_used, self.view_newest

    def horizon(self, now: float) -> tuple[int, int]:
        """(current bucket, first bucket of the horizon) at wall time `now`."""
        current = bucket_at(now, self.length, self.span)
        return current, current - self.span

    def leaves(self, bucket: int) -> float:
        """The wall time at which `bucket` leaves the horizon (k + 1 buckets after it began)."""
        return (bucket + self.span + 1) * self.length / self.span


class Plan(NamedTuple):
    """One store step the ledger asks for (`TenantBudgets` sends it, `BudgetLedger.granted` records it)."""

    key: str
    bucket: int
    first: int
    ask: int
    """Added to `bucket` if the limit allows (carry included)."""
    returns: dict[int, int]
    """Everything taken off buckets: refunds, the carried allowance, what is given back."""
    refunds: dict[int, int]
    """The part of `returns` from the allowance's pending refunds."""
    carry: int
    """Allowance moved from its old bucket into `bucket` (taken off there, asked again here)."""
    give: int
    """Allowance given back (taken off its bucket, not asked again)."""
    expires: float
    """When `bucket` leaves the horizon (the record may go then)."""


@dataclass(frozen=True, slots=True)
class Exceeded:
    """A refusal: which limit, and when enough of it frees for the request."""

    kind: Kind
    limit: int
    remaining: int
    reset_seconds: float
    too_large: bool = False
    """The request alone is over the limit: no window will admit it."""


class Quota(NamedTuple):
    """One limit's state for the x-ratelimit-* headers."""

    kind: Kind
    limit: int
    remaining: int
    reset_seconds: float
    """Seconds until everything counted now has left the horizon (the limit is whole again)."""


class BudgetLedger:
    """The pure core: this frontend's allowances per (tenant, limit), on wall times passed in."""

    def __init__(self, settings: BudgetSettings) -> None:
        self.settings = settings
        self._held: dict[tuple[str, Kind], _Allowance] = {}

    def allowance(self, tenant: str, kind: Kind) -> _Allowance:
        """The (tenant, kind) allowance (created empty)."""
        held = self._held.get((tenant, kind))
        if held is None:
            length = window_length(kind, self.settings)
            k = self.settings.buckets
            held = _Allowance(key=f"{tenant}\x00{kind.value}\x00{length:g}\x00{k}", length=length, span=k)
            self._held[(tenant, kind)] = held
        return held

    @staticmethod
    def spendable(held: _Allowance, now: float) -> int:
        """What this frontend may spend now without the store: its allowance, if of the current bucket."""
        return held.available if bucket_at(now, held.length, held.span) == held.bucket else 0

    def plan(self, tenant: str, kind: Kind, limit: int, amount: int, now: float) -> Plan | None:
        """The store step that makes `amount` fit (None: it fits already): move the allowance of
        an older bucket into the current one, reserve whole chunks covering the shortfall, and
        send pending refunds along. A carried allowance leaves `available` at once; `granted`
        records the step's outcome."""
        held = self.allowance(tenant, kind)
        current, first = held.horizon(now)
        refunds = {b: a for b, a in held.returns.items() if b >= first}
        if held.bucket == current:
            if held.available >= amount:
                return None
            carry, have = 0, held.available
        else:
            carry = held.available if held.bucket >= first else 0
            have = carry
        short = amount - have
        chunk = self.settings.chunk(limit)
        extra = math.ceil(short / chunk) * chunk if short > 0 else 0
        if extra == 0 and carry == 0:
            return None  # amount 0
        returns = dict(refunds)
        if carry:
            returns[held.bucket] = returns.get(held.bucket, 0) + carry
            held.available -= carry  # leaves now: a step that fails only underspends
        return Plan(
            held.key,
            current,
            first,
            carry + extra,
            returns,
            refunds,
            carry,
            0,
            held.leaves(current),
        )

    def give_back_plan(self, tenant: str, kind: Kind, keep: int, now: float) -> Plan | None:
        """The store step giving back what this frontend holds beyond `keep` (its unused allowance,
        if of a bucket still in the horizon, and pending refunds); None when there is nothing.
        What it gives leaves `available` at once."""
        held = self._held.get((tenant, kind))
        if held is None:
            return None
        current, first = held.horizon(now)
        refunds = {b: a for b, a in held.returns.items() if b >= first}
        give = max(0, held.available - keep) if held.bucket >= first else 0
        if not give and not refunds:
            return None
        returns = dict(refunds)
        if give:
            returns[held.bucket] = returns.get(held.bucket, 0) + give
            held.available -= give  # leaves now: requests admitted meanwhile cannot spend it
        return Plan(held.key, current, first, 0, returns, refunds, 0, give, held.leaves(current))

    def granted(self, tenant: str, kind: Kind, plan: Plan, granted: int, counts: Mapping[int, int]) -> None:
        """Records a store step's outcome (the record after it and what `plan.ask` got)."""
        held = self._held.get((tenant, kind))
        if held is None or held.key != plan.key:
            return  # forgotten meanwhile: what it got is never spent (underspend only)
        for b, amount in plan.refunds.items():
            left = held.returns.get(b, 0) - amount
            if left > 0:
                held.returns[b] = left
            else:
                held.returns.pop(b, None)
        if plan.ask and held.bucket != plan.bucket:
            # Refunds that came in during the step are still counted in the old bucket: they go
            # back as decrements of it (spending them in the new bucket would escape the sum).
            if held.available > 0 and held.bucket >= plan.first:
                held.returns[held.bucket] = held.returns.get(held.bucket, 0) + held.available
            held.bucket = plan.bucket
            held.available = 0
        held.available += granted
        held.seen = dict(counts)
        held.view_first = _NEVER  # the record changed

    def fits(self, tenant: str, needs: Iterable[tuple[Kind, int, int]], now: float) -> Exceeded | None:
        """None when every (kind, limit, amount) fits this frontend's allowance now; else the first that does not."""
        for kind, limit, amount in needs:
            held = self.allowance(tenant, kind)
            if self.spendable(held, now) < amount:
                return Exceeded(
                    kind, limit, self._remaining(held, limit, now), self._retry(held, limit, amount, now)
                )
        return None

    def fits_fast(self, tenant: str, needs: Iterable[tuple[Kind, int, int]], now: float) -> bool:
        """Whether every need fits the allowance of the current bucket (the per-request check)."""
        held_of = self._held.get
        for kind, _limit, amount in needs:
            held = held_of((tenant, kind))
            if held is None or held.available < amount:
                return False
            if math.floor(now * held.span / held.length) != held.bucket:  # bucket_at, inlined
                return False
        return True

    def take(self, tenant: str, needs: Iterable[tuple[Kind, int, int]], now: float) -> dict[Kind, int]:
        """Spends every (kind, limit, amount) (call after `fits`); returns the buckets spent from."""
        out = {}
        for kind, _limit, amount in needs:
            held = self.allowance(tenant, kind)
            held.available -= amount
            out[kind] = held.bucket
        return out

    def refund(self, tenant: str, kind: Kind, bucket: int, amount: int) -> None:
        """Gives back what a request of `bucket` reserved and did not use: to the allowance while
        that is still of `bucket`, else as a decrement of `bucket` for the next store step."""
        held = self._held.get((tenant, kind))
        if held is None or amount <= 0:
            return
        if held.bucket == bucket:
            held.available += amount
        elif bucket >= held.bucket - held.span:  # older ones have left every horizon from now on
            held.returns[bucket] = held.returns.get(bucket, 0) + amount
            if len(held.returns) > held.span + 1:
                floor = held.bucket - held.span
                held.returns = {b: a for b, a in held.returns.items() if b >= floor}

    def quotas(self, tenant: str, limits: Iterable[tuple[Kind, int]], now: float) -> list[Quota]:
        """Each limit's estimated remaining share of the fleet and seconds until it is whole again."""
        out = []
        for kind, limit in limits:
            held = self.allowance(tenant, kind)
            _used, newest = held.view(held.horizon(now)[1])
            reset = 0.0 if newest == _NEVER else held.leaves(newest) - now
            out.append(Quota(kind, limit, self._remaining(held, limit, now), max(0.0, reset)))
        return out

    @staticmethod
    def _remaining(held: _Allowance, limit: int, now: float) -> int:
        # Not reserved in the horizon by any frontend (as last seen), plus what this frontend
        # holds there unspent or is about to give back.
        _current, first = held.horizon(now)
        used, _newest = held.view(first)
        mine = held.available if held.bucket >= first else 0
        if held.returns:
            mine += sum(a for b, a in held.returns.items() if b >= first)
        return min(limit, max(0, limit - used) + mine)

    @staticmethod
    def _retry(held: _Allowance, limit: int, amount: int, now: float) -> float:
        """Seconds until enough of the horizon's reservations (as last seen) leave it for `amount`."""
        _current, first = held.horizon(now)
        live = sorted((b, c) for b, c in held.seen.items() if b >= first)
        used = sum(c for _b, c in live)
        if limit - used >= amount:
            return 0.0
        for b, c in live:
            used -= c
            if limit - used >= amount:
                return max(0.0, held.leaves(b) - now)
        return 0.0  # only when amount > limit (refused as too large before this is asked)

    def holders(self) -> list[tuple[str, Kind]]:
        """Every (tenant, kind) with an allowance (for giving back on close)."""
        return list(self._held)

    @property
    def size(self) -> int:
        """Allowances held (tenants x limits)."""
        return len(self._held)

    def forget_old(self, now: float) -> None:
        """Drops allowances whose bucket left the horizon (nothing of theirs counts any more):
        bounds memory to the tenants of the last window."""
        for key in [k for k, h in self._held.items() if h.bucket < h.horizon(now)[1]]:
            del self._held[key]


# ---- the driver -------------------------------------------------------------------------------


class BudgetExceeded(Exception):
    """A request over its tenant's budget (429 / RESOURCE_EXHAUSTED)."""

    def __init__(self, tenant: str, exceeded: Exceeded, quotas: list[Quota]) -> None:
        self.tenant = tenant
        self.exceeded = exceeded
        self.quotas = quotas
        super().__init__(
            f"{tenant} is over its budget: {exceeded.kind.value} {exceeded.limit} "
            f"(enough frees in {exceeded.reset_seconds:.0f}s)"
        )


@dataclass(slots=True)
class Ticket:
    """One admitted request's reservation; `settle` gives back what it did not use."""

    ledger: BudgetLedger | None
    """The ledger it was taken from (a reloaded policy's new ledger has other buckets)."""
    tenant: str
    reserved_tokens: int
    buckets: dict[Kind, int] = field(default_factory=dict)
    quotas: list[Quota] = field(default_factory=list)
    """The limits' state after admission (x-ratelimit-* headers)."""
    settled: bool = False

    def settle(self, used_tokens: int) -> None:
        """The request ended having used `used_tokens` (prompt + generated): the rest goes back
        (see BudgetLedger.refund). Idempotent."""
        if self.settled or self.ledger is None:
            return
        self.settled = True
        unused = max(0, self.reserved_tokens - used_tokens)
        for kind, bucket in self.buckets.items():
            if kind in _TOKEN_KINDS:
                self.ledger.refund(self.tenant, kind, bucket, unused)


UNLIMITED = Ticket(None, "", 0, settled=True)


class TenantBudgets:
    """Admits requests against their tenant's budgets: the ledger over a shared store."""

    def __init__(self, store: BudgetStore, settings: BudgetSettings, clock: Clock) -> None:
        self.store = store
        self.ledger = BudgetLedger(settings)
        self.clock = clock
        self._locks: dict[str, asyncio.Lock] = {}

    @property
    def settings(self) -> BudgetSettings:
        return self.ledger.settings

    def update_settings(self, settings: BudgetSettings) -> None:
        """A reloaded policy changed the budget settings: allowances start over (new keys)."""
        if settings != self.ledger.settings:
            self.ledger = BudgetLedger(settings)

    async def admit(self, tenant: str, policy: TenantPolicy, tokens: int) -> Ticket:
        """Reserves `tokens` (prompt + max_tokens) and one request for `tenant`; raises
        BudgetExceeded (or StoreError when the store does not answer)."""
        limits = limits_of(policy)
        if not limits:
            return UNLIMITED
        needs = [(k, limit, tokens if k in _TOKEN_KINDS else 1) for k, limit in limits]
        ledger = self.ledger
        now = self.clock.wall()
        if ledger.fits_fast(tenant, needs, now):  # the common case: no store, no await
            return self._take(ledger, tenant, needs, limits, now)
        for kind, limit, amount in needs:
            if amount > limit:  # can never fit: refused without reserving anything for it
                held = ledger.allowance(tenant, kind)
                raise BudgetExceeded(
                    tenant,
                    Exceeded(kind, limit, ledger._remaining(held, limit, now), 0.0, too_large=True),
                    ledger.quotas(tenant, limits, now),
                )
        if ledger.size > MAX_ALLOWANCES:
            ledger.forget_old(now)
        lock = self._locks.get(tenant)
        if lock is None:
            if len(self._locks) > 10_000:
                self._locks = {t: lk for t, lk in self._locks.items() if lk.locked()}
            lock = self._locks[tenant] = asyncio.Lock()
        async with lock:  # one store step at a time per tenant: concurrent requests share its chunk
            for _attempt in range(2):  # again only if a bucket ended during the steps
                planned: list[tuple[Kind, int]] = []
                for kind, limit, amount in needs:
                    plan = ledger.plan(tenant, kind, limit, amount, self.clock.wall())
                    if plan is not None:
                        granted, counts = await self._step(plan, limit)
                        ledger.granted(tenant, kind, plan, granted, counts)
                        planned.append((kind, plan.bucket))
                now = self.clock.wall()
                exceeded = ledger.fits(tenant, needs, now)
                if exceeded is None:
                    return self._take(ledger, tenant, needs, limits, now)
                if planned and all(b == ledger.allowance(tenant, k).horizon(now)[0] for k, b in planned):
                    break
            # A partial grant that did not make the request fit stays here only up to one chunk:
            # the rest goes back, so other frontends can use it.
            for kind, limit, _amount in needs:
                plan = ledger.give_back_plan(tenant, kind, self.settings.chunk(limit), now)
                if plan is not None and plan.give:
                    with contextlib.suppress(Exception):  # not given back: it only underspends
                        granted, counts = await self._step(plan, limit)
                        ledger.granted(tenant, kind, plan, granted, counts)
            now = self.clock.wall()
            refusal = ledger.fits(tenant, needs, now)
            if refusal is None:  # a refund came in meanwhile
                return self._take(ledger, tenant, needs, limits, now)
            raise BudgetExceeded(tenant, refusal, ledger.quotas(tenant, limits, now))

    async def _step(self, plan: Plan, limit: int) -> tuple[int, dict[int, int]]:
        try:
            return await self.store.reserve(
                plan.key, plan.bucket, plan.first, plan.ask, limit, plan.returns, plan.expires
            )
        except StoreError:
            raise
        except Exception as exc:  # any client failure: the store did not answer
            raise StoreError(f"the budget store did not answer: {exc!r}") from exc

    def _take(self, ledger, tenant, needs, limits, now) -> Ticket:
        buckets = ledger.take(tenant, needs, now)
        tokens = next((amount for k, _l, amount in needs if k in _TOKEN_KINDS), 0)
        return Ticket(ledger, tenant, tokens, buckets, ledger.quotas(tenant, limits, now))

    async def close(self) -> None:
        """Gives this frontend's unused allowance and pending refunds back to the shared records,
        then closes the store."""
        now = self.clock.wall()
        ledger = self.ledger
        for tenant, kind in ledger.holders():
            plan = ledger.give_back_plan(tenant, kind, 0, now)
            if plan is not None:
                with contextlib.suppress(Exception):  # a record not given back only underspends
                    granted, counts = await self._step(plan, 0)
                    ledger.granted(tenant, kind, plan, granted, counts)
        await self.store.close()


class MemoryStore:
    """Records in this process (a frontend without etcd): the same arithmetic, no fleet."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.records: dict[str, tuple[dict[int, int], float]] = {}

    async def reserve(
        self,
        key: str,
        bucket: int,
        first: int,
        ask: int,
        limit: int,
        returns: Mapping[int, int],
        expires_wall: float,
    ) -> tuple[int, dict[int, int]]:
        now = self.clock.wall()
        if len(self.records) > MAX_ALLOWANCES:  # bounded: records whose buckets all left go first
            self.records = {k: v for k, v in self.records.items() if v[1] > now}
        counts, expires = self.records.get(key, ({}, expires_wall))
        granted, after = apply_step(counts if expires > now else {}, bucket, first, ask, limit, returns)
        self.records[key] = (after, max(expires, expires_wall))
        return granted, dict(after)

    def total(self, key: str) -> int:
        """The record's sum over every bucket it still holds (tests)."""
        return sum(self.records.get(key, ({}, 0.0))[0].values())

    async def close(self) -> None:
        return None
