"""Tenant policy: who gets which priority class, weight, token budgets, regions and models (a TOML file, pure parsing).

The file (`globalrouter serve --policy FILE`)::

    [budget]                       # optional: how budgets are counted (the fleet's, not a tenant's)
    minute_seconds = 60            # the length of a "per minute" window (tests shorten it)
    day_seconds = 86400            # the length of a "per day" window
    buckets = 10                   # a window is counted in this many buckets (see budgets.py)
    chunk_fraction = 0.1           # a frontend reserves this share of a limit at a time (at least 1)

    [default]                      # every identity not listed below
    priority = 0                   # higher classes dispatch first (0-9)
    # max_priority = 0             # the highest class a request may ask for (header x-priority);
                                   # absent: its own priority (a caller may only ask for less)
    weight = 1.0                   # share within a class
    tokens_per_minute = 0          # 0: no limit
    tokens_per_day = 0
    requests_per_minute = 0
    # regions = ["eu-west"]        # absent: every region; a list: only those
    # models = ["llama"]           # absent: every model; [] : none

    [identity."client/alice"]      # or "spiffe://DOMAIN/client/alice"; "unchecked" is the
    priority = 5                   # caller of a frontend that checks nothing (loopback)
    tokens_per_minute = 10000

Identities are spelled as meshkit.identity prints them (`client/NAME`, `admin/NAME`,
`frontend/NAME`, `relay/POOL/NAME`) or as SPIFFE ids; a client is the same identity whether it
presents a certificate or an API key. An identity's entry starts from `[default]` and overrides
what it sets. Every problem is a PolicyError naming the file, the entry and the key.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from meshkit.identity import Identity, IdentityError, parse_spiffe
from meshkit.validation import MAX_ID_LENGTH, Violations, check_identifier

MAX_PRIORITY = 9
MAX_IDENTITIES = 10_000
"""Entries one file may name (each may get its own metrics label, so the set stays bounded)."""
MAX_LIST = 1_000
"""Regions or models one entry may list."""
UNCHECKED_KEY = "unchecked"
"""The policy key of the caller of a frontend that enforces nothing (meshkit.authz.UNCHECKED)."""
OTHER_LABEL = "other"
"""The metrics label of every identity the policy does not name."""


class PolicyError(ValueError):
    """A policy file that cannot be used; the message names the file, the entry and the key."""


@dataclass(frozen=True, slots=True)
class BudgetSettings:
    """How budgets are counted across the fleet."""

    minute_seconds: float = 60.0
    """Length of the window of the per-minute limits: every such window, wherever it starts, holds."""
    day_seconds: float = 86_400.0
    """Length of the window of the per-day limit."""
    buckets: int = 10
    """Buckets per window (aligned to the wall clock): reservations are counted per bucket and a
    limit checked over the last buckets + 1, so a steady tenant gets buckets / (buckets + 1) of its
    limit per window; more buckets waste less and cost a store write per bucket more often."""
    chunk_fraction: float = 0.1
    """Share of a limit a frontend reserves from the shared counter at a time: the fleet can
    hold at most one such chunk per frontend unused, and a frontend asks the store once per chunk."""

    def chunk(self, limit: int) -> int:
        """The reservation step for `limit`: its chunk_fraction, at least 1."""
        return max(1, math.ceil(limit * self.chunk_fraction))


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """What one identity may do; 0 for a limit means none."""

    name: str = "default"
    """The policy key ("client/alice"), or "default" for identities not listed."""
    priority: int = 0
    """Priority class: higher dispatches first."""
    max_priority: int | None = None
    """The highest class a request may ask for with the `x-priority` header (gRPC metadata or
    HTTP); None: `priority` (a caller may ask for a lower class than its own, never a higher).
    Its own `priority` is always allowed, whatever this says."""
    weight: float = 1.0
    """Share within its class, relative to the others'."""
    tokens_per_minute: int = 0
    tokens_per_day: int = 0
    requests_per_minute: int = 0
    regions: frozenset[str] | None = None
    """Regions whose pools it may use; None: every region."""
    models: frozenset[str] | None = None
    """Models it may use; None: every model."""

    @property
    def highest_priority(self) -> int:
        """The highest class its requests may ask for (at least its own)."""
        return self.priority if self.max_priority is None else max(self.priority, self.max_priority)

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models

    def allows_region(self, region: str) -> bool:
        return self.regions is None or region in self.regions

    @property
    def limited(self) -> bool:
        """Whether any budget applies."""
        return bool(self.tokens_per_minute or self.tokens_per_day or self.requests_per_minute)


def policy_key(identity: Identity) -> str:
    """The key an identity is listed under: `client/alice`, ..., or "unchecked"."""
    if identity.source == "unchecked":
        return UNCHECKED_KEY
    return str(identity)


@dataclass(frozen=True, slots=True)
class Policy:
    """A parsed policy file. The empty Policy() lets everyone do everything (no file given)."""

    default: TenantPolicy = field(default_factory=TenantPolicy)
    entries: Mapping[str, TenantPolicy] = field(default_factory=dict)
    budget: BudgetSettings = field(default_factory=BudgetSettings)
    source: str = ""
    """The file it came from ("" when built in code)."""

    def for_identity(self, identity: Identity) -> TenantPolicy:
        """The identity's policy: its own entry, else the default."""
        return self.entries.get(policy_key(identity), self.default)

    def label(self, identity: Identity) -> str:
        """The metrics label for `identity`: its key when listed, else "other" (bounded cardinality)."""
        key = policy_key(identity)
        return key if key in self.entries else OTHER_LABEL

    def changes(self, new: Policy) -> list[str]:
        """What differs from `self` to `new`, one phrase each (for the reload log)."""
        out = []
        if self.budget != new.budget:
            out.append(f"budget settings {_diff(self.budget, new.budget)}")
        if self.default != new.default:
            out.append(f"default {_diff(self.default, new.default)}")
        for key in sorted(set(self.entries) | set(new.entries)):
            old, now = self.entries.get(key), new.entries.get(key)
            if old is None:
                out.append(f"added {key}")
            elif now is None:
                out.append(f"removed {key}")
            elif old != now:
                out.append(f"{key} {_diff(old, now)}")
        return out


def _diff(old: Any, new: Any) -> str:
    parts = []
    for f in fields(old):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a != b:
            parts.append(f"{f.name}: {_show(a)} -> {_show(b)}")
    return ", ".join(parts)


def _show(value: Any) -> str:
    if isinstance(value, frozenset):
        return "[" + ", ".join(sorted(value)) + "]"
    if value is None:
        return "any"
    return str(value)


# ---- parsing ----------------------------------------------------------------------------------

_LIMITS = ("tokens_per_minute", "tokens_per_day", "requests_per_minute")
_ENTRY_KEYS = frozenset({"priority", "max_priority", "weight", *_LIMITS, "regions", "models"})
_BUDGET_KEYS = frozenset({"minute_seconds", "day_seconds", "buckets", "chunk_fraction"})
MAX_BUCKETS = 100
"""Buckets per window at most (each admission that reserves sums that many counters)."""
_TOP_KEYS = frozenset({"budget", "default", "identity"})


def load(path: str | Path) -> Policy:
    """Reads and checks a policy file. Raises PolicyError naming the file, entry and key."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"{path}: cannot be read: {exc}") from exc
    return parse(text, str(path))


def parse(text: str, source: str = "<policy>") -> Policy:
    """Parses the TOML text of a policy file (`source` names it in errors)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: not valid TOML: {exc}") from exc
    unknown = sorted(set(doc) - _TOP_KEYS)
    if unknown:
        raise PolicyError(
            f"{source}: unknown top-level key {unknown[0]!r} (expected budget, default, identity)"
        )
    budget = _budget(_table(doc, "budget", source, "[budget]"), source)
    default = _entry(_table(doc, "default", source, "[default]"), TenantPolicy(), "[default]", source)
    identities = _table(doc, "identity", source, "[identity]")
    if len(identities) > MAX_IDENTITIES:
        raise PolicyError(f"{source}: [identity] lists {len(identities)} entries (at most {MAX_IDENTITIES})")
    entries: dict[str, TenantPolicy] = {}
    for raw_key, value in identities.items():
        where = f'[identity."{raw_key}"]'
        key = _identity_key(raw_key, source, where)
        if key in entries:
            raise PolicyError(f"{source}: {where}: names {key!r}, which another entry names too")
        if not isinstance(value, dict):
            raise PolicyError(f"{source}: {where}: must be a table of settings")
        entries[key] = _entry(value, replace(default, name=key), where, source)
    return Policy(default=default, entries=entries, budget=budget, source=source)


def _table(doc: Mapping[str, Any], key: str, source: str, where: str) -> dict[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise PolicyError(f"{source}: {where}: must be a table")
    return value


def _identity_key(raw: str, source: str, where: str) -> str:
    """The canonical key of an identity spelled as `client/NAME`, a SPIFFE id, or "unchecked"."""
    if raw == UNCHECKED_KEY:
        return raw
    if raw.startswith("spiffe://"):
        domain = raw.removeprefix("spiffe://").partition("/")[0]
        uri = raw
    else:
        domain, uri = "policy.invalid", "spiffe://policy.invalid/" + raw
    if len(raw) > 4 * MAX_ID_LENGTH:
        raise PolicyError(f"{source}: {where}: the identity is longer than {4 * MAX_ID_LENGTH} characters")
    try:
        return str(parse_spiffe(uri, domain))
    except IdentityError as exc:
        raise PolicyError(
            f"{source}: {where}: not an identity ({exc}); write ROLE/NAME (client/alice, relay/POOL/NAME), "
            f'a spiffe:// id, or "{UNCHECKED_KEY}"'
        ) from exc


def _budget(table: Mapping[str, Any], source: str) -> BudgetSettings:
    unknown = sorted(set(table) - _BUDGET_KEYS)
    if unknown:
        raise PolicyError(
            f"{source}: [budget]: unknown key {unknown[0]!r} (expected {', '.join(sorted(_BUDGET_KEYS))})"
        )
    out = BudgetSettings()
    for key in ("minute_seconds", "day_seconds"):
        if key in table:
            value = _number(table[key], source, "[budget]", key)
            if not 1.0 <= value <= 366 * 86_400:
                raise PolicyError(
                    f"{source}: [budget]: {key} must be 1 to {366 * 86_400} seconds (got {value})"
                )
            seconds: dict[str, Any] = {key: value}
            out = replace(out, **seconds)
    if "buckets" in table:
        out = replace(out, buckets=_whole(table["buckets"], source, "[budget]", "buckets", 1, MAX_BUCKETS))
    if "chunk_fraction" in table:
        value = _number(table["chunk_fraction"], source, "[budget]", "chunk_fraction")
        if not 0.0 < value <= 1.0:
            raise PolicyError(
                f"{source}: [budget]: chunk_fraction must be above 0 and at most 1 (got {value})"
            )
        out = replace(out, chunk_fraction=value)
    return out


def _whole(value: Any, source: str, where: str, key: str, low: int, high: int, shown: str = "") -> int:
    """A whole number low to high (not a bool), or a PolicyError naming the entry and key
    (`shown`: how the range reads in it, e.g. "0 to 10^15, 0 meaning no limit")."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PolicyError(
            f"{source}: {where}: {key} must be a whole number {shown or f'{low} to {high}'} (got {value!r})"
        )
    return value


def _number(value: Any, source: str, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PolicyError(f"{source}: {where}: {key} must be a finite number (got {value!r})")
    return float(value)


def _entry(table: Mapping[str, Any], base: TenantPolicy, where: str, source: str) -> TenantPolicy:
    unknown = sorted(set(table) - _ENTRY_KEYS)
    if unknown:
        raise PolicyError(
            f"{source}: {where}: unknown key {unknown[0]!r} (expected {', '.join(sorted(_ENTRY_KEYS))})"
        )
    out = base
    if "priority" in table:
        out = replace(out, priority=_whole(table["priority"], source, where, "priority", 0, MAX_PRIORITY))
    if "max_priority" in table:
        highest = _whole(table["max_priority"], source, where, "max_priority", 0, MAX_PRIORITY)
        out = replace(out, max_priority=highest)
    if "weight" in table:
        value = _number(table["weight"], source, where, "weight")
        if not 0.0 < value <= 1e6:
            raise PolicyError(f"{source}: {where}: weight must be above 0 and at most 1e6 (got {value})")
        out = replace(out, weight=value)
    for key in _LIMITS:
        if key in table:
            value = _whole(table[key], source, where, key, 0, 10**15, "0 to 10^15, 0 meaning no limit")
            changes: dict[str, Any] = {key: value}
            out = replace(out, **changes)
    for key in ("regions", "models"):
        if key in table:
            names: dict[str, Any] = {key: _names(table[key], source, where, key)}
            out = replace(out, **names)
    return out


def _names(value: Any, source: str, where: str, key: str) -> frozenset[str]:
    if not isinstance(value, list):
        raise PolicyError(f"{source}: {where}: {key} must be a list of names (got {value!r})")
    if len(value) > MAX_LIST:
        raise PolicyError(f"{source}: {where}: {key} lists {len(value)} names (at most {MAX_LIST})")
    for i, name in enumerate(value):
        v = Violations()
        if not isinstance(name, str):
            raise PolicyError(f"{source}: {where}: {key}[{i}] must be a string (got {name!r})")
        check_identifier(v, f"{key}[{i}]", name)
        if v:
            raise PolicyError(f"{source}: {where}: " + "; ".join(f"{f} {d}" for f, d in v.items))
    return frozenset(value)


class PolicyFile:
    """The policy in force and the file it came from; `reload` (SIGHUP) re-reads it, keeping the
    policy in force when the new file is refused."""

    def __init__(self, path: str | Path | None) -> None:
        """Reads `path` (None: the empty policy, everyone may do everything). Raises PolicyError."""
        self.path = str(path) if path else ""
        self.current = load(path) if path else Policy()

    def reload(self) -> bool:
        """Re-reads the file; True when the new policy is in force. Logs what changed, or why the
        file was refused."""
        if not self.path:
            return True
        from meshkit.logs import get_logger

        log = get_logger(module="globalrouter.policy")
        try:
            new = load(self.path)
        except PolicyError as exc:
            log.error("policy file refused; the policy in force stays", error=str(exc))
            return False
        changes = self.current.changes(new)
        self.current = new
        log.info("policy reloaded", path=self.path, changes=changes or "none")
        return True
