"""Public model names: aliases from an operator's TOML file (with blue/green splits) and LoRA adapters, resolved in one place.

The file (`globalrouter serve --aliases FILE`, re-read on SIGHUP) has one table:

    [aliases]
    fast = "llama-v1"                            # an alias for one model
    chat = { "llama-v1" = 0.9, "llama-v2" = 0.1 }  # a split: weights, normalised
    sql = "llama-v1:sql-lora"                    # an alias for an adapter of a model

A request names a model (`llama-v1`), an adapter of one (`llama-v1:sql-lora`, or the adapter's
own name `sql-lora` when one model serves it, as vLLM names it), or an alias. A split picks its
target per request from a hash of the request id (xxh3 into [0, 1), against the cumulative
weights), so a retried request id and every frontend replica pick the same target, and a 0.9 /
0.1 split sends 10 % of distinct request ids to the second model.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import xxhash

from meshkit.logs import get_logger
from meshkit.validation import Violations, check_identifier

log = get_logger(module="globalrouter.aliases")

MAX_ALIASES = 1024
MAX_TARGETS = 16
"""Models one alias may split its traffic over."""
MAX_FILE_BYTES = 1024 * 1024
ADAPTER_SEPARATOR = ":"
_UNIT = float(1 << 64)


class ServingPool(Protocol):
    """What resolution reads of a pool (globalrouter.pool_state.PoolState)."""

    listed: bool
    model: str
    adapters: dict[str, frozenset[str]]


class AliasError(ValueError):
    """A bad aliases file; the text names the file and the key at fault."""


class ResolveError(ValueError):
    """A name that resolves to nothing unambiguous (the text says why and what to name instead)."""


@dataclass(frozen=True, slots=True)
class Target:
    """A model, optionally one of its LoRA adapters."""

    model: str
    adapter: str = ""

    def __str__(self) -> str:
        return f"{self.model}{ADAPTER_SEPARATOR}{self.adapter}" if self.adapter else self.model


@dataclass(frozen=True, slots=True)
class Alias:
    """A public name and the targets it sends traffic to, with cumulative weights ending at 1."""

    name: str
    targets: tuple[Target, ...]
    weights: tuple[float, ...]
    """Each target's share of the traffic (normalised: they sum to 1)."""

    def pick(self, request_id: str) -> Target:
        """The target for this request id (the same id always picks the same target)."""
        if len(self.targets) == 1:
            return self.targets[0]
        point = xxhash.xxh3_64_intdigest(request_id.encode("utf-8")) / _UNIT
        upto = 0.0
        for target, weight in zip(self.targets, self.weights, strict=True):
            upto += weight
            if point < upto and weight > 0:
                return target
        return next(t for t, w in zip(reversed(self.targets), reversed(self.weights), strict=True) if w > 0)


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a request's model name stands for."""

    model: str
    """The registered model to route to."""
    adapter: str = ""
    """The LoRA adapter of `model` ("" for the base model)."""
    alias: str = ""
    """The alias the request named ("" when it named the model or adapter itself)."""

    @property
    def served_name(self) -> str:
        """The name an OpenAI pool knows the target by: the adapter's (vLLM's) or the model's."""
        return self.adapter or self.model


def parse_target(text: str, where: str) -> Target:
    """`model` or `model:adapter`; raises AliasError naming `where`."""
    model, sep, adapter = text.rpartition(ADAPTER_SEPARATOR)
    if not sep:
        model, adapter = text, ""
    v = Violations()
    check_identifier(v, where, model)
    if sep:
        check_identifier(v, f"{where} (adapter)", adapter)
    if v:
        raise AliasError("; ".join(f"{f}: {d}" for f, d in v.items))
    return Target(model, adapter)


def parse_aliases(data: Mapping[str, object], source: str) -> dict[str, Alias]:
    """The aliases of a decoded TOML document; raises AliasError naming `source` and the key."""
    unknown = sorted(set(data) - {"aliases"})
    if unknown:
        raise AliasError(f"{source}: unknown key {unknown[0]!r} (the file has one table, [aliases])")
    table = data.get("aliases", {})
    if not isinstance(table, dict):
        raise AliasError(f"{source}: aliases must be a table")
    if len(table) > MAX_ALIASES:
        raise AliasError(f"{source}: aliases has {len(table)} entries (at most {MAX_ALIASES})")
    out: dict[str, Alias] = {}
    for name, value in table.items():
        key = f"{source}: aliases.{name}"
        v = Violations()
        check_identifier(v, key, name)
        if v:
            raise AliasError("; ".join(f"{f}: {d}" for f, d in v.items))
        if ADAPTER_SEPARATOR in name:
            raise AliasError(f"{key}: an alias name must not contain {ADAPTER_SEPARATOR!r}")
        if isinstance(value, str):
            out[name] = Alias(name, (parse_target(value, key),), (1.0,))
            continue
        if not isinstance(value, dict) or not value:
            raise AliasError(
                f"{key}: must be a model name or a table of model = weight (got {type(value).__name__})"
            )
        if len(value) > MAX_TARGETS:
            raise AliasError(f"{key}: splits over {len(value)} models (at most {MAX_TARGETS})")
        targets, weights = [], []
        for target, weight in value.items():
            wkey = f"{key}.{target}"
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise AliasError(f"{wkey}: a weight must be a number (got {type(weight).__name__})")
            if not math.isfinite(weight) or weight < 0:
                raise AliasError(f"{wkey}: a weight must be a finite number ≥ 0 (got {weight})")
            targets.append(parse_target(target, wkey))
            weights.append(float(weight))
        total = sum(weights)
        if total <= 0:
            raise AliasError(f"{key}: the weights sum to 0 (at least one must be > 0)")
        out[name] = Alias(name, tuple(targets), tuple(w / total for w in weights))
    return out


def load_aliases(path: str) -> dict[str, Alias]:
    """The aliases of a TOML file; raises AliasError naming the file (and the key) on any problem."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise AliasError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise AliasError(f"{path}: is larger than {MAX_FILE_BYTES} bytes")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise AliasError(f"{path}: is not TOML ({exc})") from None
    return parse_aliases(data, path)


class ModelResolver:
    """Resolves the model name a request gives, against the aliases in force and the adapters
    the listed pools serve; the aliases are replaced whole by `reload` (SIGHUP)."""

    def __init__(self, aliases: Mapping[str, Alias] | None = None, path: str = "") -> None:
        self.path = path
        self.aliases: Mapping[str, Alias] = dict(aliases or {})

    @classmethod
    def from_file(cls, path: str) -> ModelResolver:
        """The resolver of an aliases file (no file: no aliases); raises AliasError."""
        return cls(load_aliases(path) if path else {}, path)

    def reload(self) -> bool:
        """Re-reads the aliases file; a bad file is logged and the aliases in force are kept.
        True when the new aliases are in force."""
        if not self.path:
            return False
        try:
            aliases = load_aliases(self.path)
        except AliasError as exc:
            log.error("aliases file refused; the aliases in force are kept", error=str(exc))
            return False
        self.aliases = aliases
        log.info("aliases reloaded", path=self.path, aliases=len(aliases))
        return True

    def resolve(self, name: str, request_id: str, pools: Collection[ServingPool]) -> Resolved:
        """What `name` stands for, against the listed `pools` (their model and the adapters
        served on it). Order: an alias (its target picked by the request id); a model some pool
        serves; `model:adapter`; an adapter's own name when exactly one model serves it; else
        the name as a model (routing then says no pool serves it). Raises ResolveError when an
        adapter's name is served on several models."""
        alias = self.aliases.get(name)
        if alias is not None:
            target = alias.pick(request_id)
            return Resolved(target.model, target.adapter, name)
        # The common case, a model's own name, stops at the first pool serving it.
        if any(p.model == name and p.listed for p in pools):
            return Resolved(name)
        model, sep, adapter = name.rpartition(ADAPTER_SEPARATOR)
        if sep and model and adapter and any(p.model == model and p.listed for p in pools):
            return Resolved(model, adapter)
        parents = sorted({p.model for p in pools if p.listed and name in p.adapters.get(p.model, ())})
        if len(parents) == 1:
            return Resolved(parents[0], name)
        if len(parents) > 1:
            raise ResolveError(
                f"adapter {name!r} is served on several models ({', '.join(parents)}): "
                f"name one as MODEL{ADAPTER_SEPARATOR}{name}"
            )
        return Resolved(name)


def served_models(pools: Iterable[ServingPool]) -> dict[str, set[str]]:
    """Model -> the adapters served on it, over the listed pools (for /v1/models)."""
    out: dict[str, set[str]] = {}
    for p in pools:
        if p.listed and p.model:
            out.setdefault(p.model, set()).update(p.adapters.get(p.model, ()))
    return out


def model_cards(pools: Iterable[ServingPool], aliases: Mapping[str, Alias], owner: str) -> list[dict]:
    """`GET /v1/models` entries, as vLLM lists them: each served model (`parent` null), each
    LoRA adapter served on one (`parent` naming its model, `root` too: the mesh knows no path),
    each alias (`parent` null, `root` its one target, null for a split); sorted by id, a name
    listed once (an alias shadows a model or adapter of its name, as in resolution)."""
    cards: dict[str, dict] = {}

    def card(name: str, root: str | None, parent: str | None) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": owner,
            "root": root,
            "parent": parent,
        }

    for model, adapters in served_models(pools).items():
        cards[model] = card(model, model, None)
        for adapter in adapters:
            cards.setdefault(adapter, card(adapter, model, model))
    for alias in aliases.values():
        root = str(alias.targets[0]) if len(alias.targets) == 1 else None
        cards[alias.name] = card(alias.name, root, None)
    return [cards[k] for k in sorted(cards)]
