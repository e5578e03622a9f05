"""Tenant budgets that hold across frontend replicas: tokens per minute and per day, requests per minute.

Each limit is counted in fixed windows aligned to the wall clock (window i covers
[i * length, (i + 1) * length)), so every frontend agrees on which window a moment belongs to.
One shared counter per (tenant, limit, window) says how much of the limit frontends have
*reserved*; a frontend reserves allowance from it in chunks (the policy's chunk_fraction of the
limit), never past the limit, and spends from its own chunk without asking anyone. So the fleet
never admits more than the limit in a window, and at most one chunk per frontend of it stays
reserved and unused (underspend, not overspend). The counter lives in the store (etcd for a
fleet, memory for a lone frontend), so a restarted frontend finds what was spent before it; a
frontend that stops gives its unused allowance back, and one that dies holds its chunk until
the window ends (the counter's etcd lease ends with the window).

Tokens: a request reserves prompt + max_tokens at admission and gives back what it did not
generate when it ends (`Ticket.settle`): the limit holds for what is generated however the
stream goes, at the cost of refusing a request that might have fitted with fewer output tokens.

`BudgetLedger` is the pure core (window arithmetic, chunk accounting, what to reserve next) on
times passed in; `TenantBudgets` drives it over a `BudgetStore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Protocol

from globalrouter.policy import BudgetSettings, TenantPolicy
from meshkit.clock import Clock
from meshkit.logs import get_logger

log = get_logger(module="globalrouter.budgets")

MAX_ALLOWANCES = 100_000
"""Allowances (tenant x limit) kept before those of past windows are dropped."""


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


def window_at(wall: float, length: float) -> tuple[int, float]:
    """(index, end) of the window of `length` seconds holding wall time `wall`."""
    index = math.floor(wall / length)
    return index, (index + 1) * length


@functools.lru_cache(maxsize=4096)
def limits_of(policy: TenantPolicy) -> tuple[tuple[Kind, int], ...]:
    """The limits that apply (those above 0); looked up once per policy entry."""
    return tuple((k, getattr(policy, k.value)) for k in Kind if getattr(policy, k.value) > 0)


class BudgetStore(Protocol):
    """The shared counters: how much of each limit frontends have reserved, per window."""

    async def reserve(self, key: str, ask: int, limit: int, expires_wall: float) -> tuple[int, int]:
        """Adds up to `ask` to counter `key`, never past `limit`; returns (granted, counter after).
        The counter may be forgotten after `expires_wall` (its window is over)."""
        ...

    async def give_back(self, key: str, amount: int) -> None:
        """Takes `amount` (reserved, unused) off counter `key`, not below 0."""
        ...

    async def close(self) -> None: ...


class StoreError(Exception):
    """The budget store did not answer; the request is refused UNAVAILABLE (fail closed)."""


@dataclass(slots=True)
class _Allowance:
    """This frontend's reservation for one (tenant, limit) in its current window."""

    key: str
    window: int
    end: float
    start: float = 0.0
    available: int = 0
    """Reserved from the shared counter and not spent by this frontend."""
    counter: int = 0
    """The shared counter as last seen (every frontend's reservations)."""


@dataclass(frozen=True, slots=True)
class Exceeded:
    """A refusal: which limit, and when its window resets."""

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


class BudgetLedger:
    """The pure core: this frontend's allowances per (tenant, limit), on wall times passed in."""

    def __init__(self, settings: BudgetSettings) -> None:
        self.settings = settings
        self._held: dict[tuple[str, Kind], _Allowance] = {}

    def allowance(self, tenant: str, kind: Kind, now: float) -> _Allowance:
        """The (tenant, kind) allowance of the window holding `now`; a new window starts empty
        (what was left of the last one is gone with it: its counter is another key)."""
        held = self._held.get((tenant, kind))
        if held is not None and held.start <= now < held.end:  # the common case, per request
            return held
        length = window_length(kind, self.settings)
        index, end = window_at(now, length)
        if held is None or held.window != index:
            held = _Allowance(
                key=f"{tenant}\x00{kind.value}\x00{length:g}\x00{index}",
                window=index,
                end=end,
                start=end - length,
            )
            self._held[(tenant, kind)] = held
        return held

    def ask(self, tenant: str, kind: Kind, limit: int, amount: int, now: float) -> int:
        """How much to reserve from the store so that `amount` fits (0: it fits already): whole
        chunks, at least the shortfall."""
        held = self.allowance(tenant, kind, now)
        short = amount - held.available
        if short <= 0:
            return 0
        chunk = self.settings.chunk(limit)
        return math.ceil(short / chunk) * chunk

    def granted(self, tenant: str, kind: Kind, window: int, granted: int, counter: int) -> None:
        """Records a reservation the store granted for `window` (ignored if that window is over)."""
        held = self._held.get((tenant, kind))
        if held is None or held.window != window:
            return
        held.available += granted
        held.counter = max(held.counter, counter)

    def fits(self, tenant: str, needs: Iterable[tuple[Kind, int, int]], now: float) -> Exceeded | None:
        """None when every (kind, limit, amount) fits this frontend's allowance; else the first that does not."""
        for kind, limit, amount in needs:
            held = self.allowance(tenant, kind, now)
            if held.available < amount:
                return Exceeded(kind, limit, self._remaining(held, limit), max(0.0, held.end - now))
        return None

    def take(self, tenant: str, needs: Iterable[tuple[Kind, int, int]], now: float) -> dict[Kind, int]:
        """Spends every (kind, limit, amount) (call after `fits`); returns the windows spent from."""
        out = {}
        for kind, _limit, amount in needs:
            held = self.allowance(tenant, kind, now)
            held.available -= amount
            out[kind] = held.window
        return out

    def refund(self, tenant: str, kind: Kind, window: int, amount: int) -> None:
        """Gives back to this frontend's allowance what a request reserved and did not use (only
        while its window lasts: an old window's counter is no longer read)."""
        held = self._held.get((tenant, kind))
        if held is not None and held.window == window and amount > 0:
            held.available += amount

    def quotas(self, tenant: str, limits: Iterable[tuple[Kind, int]], now: float) -> list[Quota]:
        """Each limit's estimated remaining share of the fleet and seconds to its reset."""
        out = []
        for kind, limit in limits:
            held = self.allowance(tenant, kind, now)
            out.append(Quota(kind, limit, self._remaining(held, limit), max(0.0, held.end - now)))
        return out

    @staticmethod
    def _remaining(held: _Allowance, limit: int) -> int:
        # Not yet reserved by any frontend, plus what this frontend holds unspent.
        return max(0, limit - held.counter) + held.available

    def unused(self, now: float) -> list[tuple[str, int]]:
        """(counter key, amount) of every allowance of a current window with some left (to give back)."""
        return [
            (h.key, h.available)
            for (_t, kind), h in self._held.items()
            if h.available > 0 and h.window == window_at(now, window_length(kind, self.settings))[0]
        ]

    def excess(self, tenant: str, limits: Iterable[tuple[Kind, int]], now: float) -> list[tuple[Kind, int]]:
        """(kind, amount) held beyond one chunk, per limit: what a refused request's reservation
        should give back."""
        out = []
        for kind, limit in limits:
            extra = self.allowance(tenant, kind, now).available - self.settings.chunk(limit)
            if extra > 0:
                out.append((kind, extra))
        return out

    @property
    def size(self) -> int:
        """Allowances held (tenants x limits)."""
        return len(self._held)

    def forget_old(self, now: float) -> None:
        """Drops allowances of windows that are over (bounds memory to the tenants of current windows)."""
        for key in [k for k, h in self._held.items() if h.end <= now]:
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
            f"(resets in {exceeded.reset_seconds:.0f}s)"
        )


@dataclass(slots=True)
class Ticket:
    """One admitted request's reservation; `settle` gives back what it did not use."""

    budgets: TenantBudgets | None
    tenant: str
    reserved_tokens: int
    windows: dict[Kind, int] = field(default_factory=dict)
    quotas: list[Quota] = field(default_factory=list)
    """The limits' state after admission (x-ratelimit-* headers)."""
    settled: bool = False

    def settle(self, used_tokens: int) -> None:
        """The request ended having used `used_tokens` (prompt + generated): the rest returns to
        this frontend's allowance. Idempotent."""
        if self.settled or self.budgets is None:
            return
        self.settled = True
        unused = max(0, self.reserved_tokens - used_tokens)
        for kind, window in self.windows.items():
            if kind in _TOKEN_KINDS:
                self.budgets.ledger.refund(self.tenant, kind, window, unused)


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
        if ledger.fits(tenant, needs, now) is None:  # the fast path: no store, no await
            return self._take(tenant, needs, limits, now)
        for kind, limit, amount in needs:
            if amount > limit:  # can never fit: refused without reserving anything for it
                held = ledger.allowance(tenant, kind, now)
                raise BudgetExceeded(
                    tenant,
                    Exceeded(
                        kind, limit, ledger._remaining(held, limit), max(0.0, held.end - now), too_large=True
                    ),
                    ledger.quotas(tenant, limits, now),
                )
        if ledger.size > MAX_ALLOWANCES:
            ledger.forget_old(now)
        lock = self._locks.get(tenant)
        if lock is None:
            if len(self._locks) > 10_000:
                self._locks = {t: lk for t, lk in self._locks.items() if lk.locked()}
            lock = self._locks[tenant] = asyncio.Lock()
        async with lock:  # one reservation at a time per tenant: concurrent requests share its chunk
            for kind, limit, amount in needs:
                now = self.clock.wall()
                ask = ledger.ask(tenant, kind, limit, amount, now)
                if ask == 0:
                    continue
                held = ledger.allowance(tenant, kind, now)
                try:
                    granted, counter = await self.store.reserve(held.key, ask, limit, held.end)
                except StoreError:
                    raise
                except Exception as exc:  # any client failure: the store did not answer
                    raise StoreError(f"the budget store did not answer: {exc!r}") from exc
                ledger.granted(tenant, kind, held.window, granted, counter)
            now = self.clock.wall()
            exceeded = ledger.fits(tenant, needs, now)
            if exceeded is not None:
                # A partial grant that did not make the request fit stays here only up to one
                # chunk: the rest goes back, so other frontends can use it this window.
                for kind, excess in ledger.excess(tenant, [(k, limit) for k, limit, _ in needs], now):
                    held = ledger.allowance(tenant, kind, now)
                    with contextlib.suppress(Exception):  # not given back: it only underspends
                        await self.store.give_back(held.key, excess)
                        held.available -= excess
                        held.counter -= excess
                raise BudgetExceeded(tenant, exceeded, ledger.quotas(tenant, limits, now))
            return self._take(tenant, needs, limits, now)

    def _take(self, tenant, needs, limits, now) -> Ticket:
        windows = self.ledger.take(tenant, needs, now)
        tokens = next((amount for k, _l, amount in needs if k in _TOKEN_KINDS), 0)
        return Ticket(self, tenant, tokens, windows, self.ledger.quotas(tenant, limits, now))

    async def close(self) -> None:
        """Gives this frontend's unused allowance back to the shared counters, then closes the store."""
        now = self.clock.wall()
        for key, amount in self.ledger.unused(now):
            with contextlib.suppress(Exception):  # a counter not given back only underspends
                await self.store.give_back(key, amount)
        await self.store.close()


class MemoryStore:
    """Counters in this process (a frontend without etcd): the same arithmetic, no fleet."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.counters: dict[str, tuple[int, float]] = {}

    async def reserve(self, key: str, ask: int, limit: int, expires_wall: float) -> tuple[int, int]:
        now = self.clock.wall()
        if len(self.counters) > 100_000:  # bounded: windows that are over go first
            self.counters = {k: v for k, v in self.counters.items() if v[1] > now}
        counter, _ = self.counters.get(key, (0, expires_wall))
        granted = max(0, min(ask, limit - counter))
        self.counters[key] = (counter + granted, expires_wall)
        return granted, counter + granted

    async def give_back(self, key: str, amount: int) -> None:
        if key in self.counters:
            counter, expires = self.counters[key]
            self.counters[key] = (max(0, counter - amount), expires)

    async def close(self) -> None:
        return None
