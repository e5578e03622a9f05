"""Every request of a chaos run, classified (completed exact, failed with a clear error, or lost),
and the per-phase table CHAOS.md shows (pure: no processes, no gRPC)."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

EXACT = "exact"
CLEAN_ERROR = "clean_error"
LOST = "lost"

# Codes a request may fail with and still count as a clean, explained failure: the mesh said why.
CLEAN_CODES = frozenset(
    {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "NOT_FOUND", "ABORTED", "FAILED_PRECONDITION", "CANCELLED"}
)


@dataclass(frozen=True)
class RequestRecord:
    """One request as its client saw it."""

    client: int
    phase: str
    """The phase running when the request ended: a request a fault hit counts in that fault's row."""
    started: float
    latency: float
    outcome: str
    """EXACT, CLEAN_ERROR or LOST."""
    tokens: int
    failovers: int = 0
    migrations: int = 0
    detail: str = ""
    """For errors and losses: what happened."""


def classify(
    expected: list[int],
    received: list[int],
    *,
    finished: bool,
    error_code: str | None = None,
    error_message: str = "",
) -> tuple[str, str]:
    """The outcome of one request and a sentence: EXACT when it finished with exactly the tokens of
    an uninterrupted run; CLEAN_ERROR when it failed with a code and a message and every token it
    did receive is right; LOST otherwise (wrong, missing or repeated tokens, a silent hang)."""
    if finished and error_code is None:
        if received == expected:
            return EXACT, ""
        return LOST, f"finished with {len(received)} tokens that differ from an uninterrupted run"
    if received != expected[: len(received)]:
        return LOST, f"{error_code}: the {len(received)} tokens received differ from an uninterrupted run"
    if error_code in CLEAN_CODES and error_message:
        return CLEAN_ERROR, f"{error_code}: {error_message}"
    return LOST, f"{error_code or 'no error'}: {error_message or 'no explanation'}"


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of `values`; None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class PhaseRow:
    """One row of CHAOS.md."""

    phase: str
    requests: int
    exact: int
    clean_errors: int
    lost: int
    p99: float | None
    baseline_p99: float | None
    failovers: int
    migrations: int
    errors: list[str] = field(default_factory=list)
    """Why requests failed or were lost (a few kinds)."""
    failover_causes: list[str] = field(default_factory=list)
    """Why completed requests failed over between frontends (a few kinds)."""

    @property
    def p99_ratio(self) -> float | None:
        if self.p99 is None or not self.baseline_p99:
            return None
        return self.p99 / self.baseline_p99


class Ledger:
    """Thread-safe record of every request; the phases in the order they ran."""

    def __init__(self, baseline: str = "quiet") -> None:
        self.baseline = baseline
        self.records: list[RequestRecord] = []
        self.phases: list[str] = []
        self._lock = threading.Lock()

    def begin(self, phase: str) -> None:
        with self._lock:
            if phase not in self.phases:
                self.phases.append(phase)

    def add(self, record: RequestRecord) -> None:
        with self._lock:
            self.records.append(record)

    def rows(self) -> list[PhaseRow]:
        with self._lock:
            records = list(self.records)
        baseline = percentile(
            (r.latency for r in records if r.phase == self.baseline and r.outcome == EXACT), 99
        )
        rows = []
        for phase in self.phases:
            mine = [r for r in records if r.phase == phase]
            rows.append(
                PhaseRow(
                    phase=phase,
                    requests=len(mine),
                    exact=sum(r.outcome == EXACT for r in mine),
                    clean_errors=sum(r.outcome == CLEAN_ERROR for r in mine),
                    lost=sum(r.outcome == LOST for r in mine),
                    p99=percentile((r.latency for r in mine if r.outcome == EXACT), 99),
                    baseline_p99=baseline,
                    failovers=sum(r.failovers for r in mine),
                    migrations=sum(r.migrations for r in mine),
                    errors=sorted({r.detail for r in mine if r.outcome != EXACT})[:5],
                    failover_causes=sorted({r.detail for r in mine if r.outcome == EXACT and r.detail})[:3],
                )
            )
        return rows

    def dump(self, path: Path) -> None:
        """Every record as one JSON line (kept beside the processes' logs)."""
        with self._lock:
            records = list(self.records)
        path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))

    @property
    def lost(self) -> int:
        with self._lock:
            return sum(r.outcome == LOST for r in self.records)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render_table(rows: list[PhaseRow]) -> str:
    """The markdown table of CHAOS.md, one row per phase."""
    lines = [
        "| phase | requests | completed exact | clean errors | lost | p99 s (fault) | p99 s (quiet) | p99 ratio "
        "| client fail-overs | pool migrations |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "-" if r.p99_ratio is None else f"{r.p99_ratio:.2f}"
        lines.append(
            f"| {r.phase} | {r.requests} | {r.exact} | {r.clean_errors} | {r.lost} | {_seconds(r.p99)} | "
            f"{_seconds(r.baseline_p99)} | {ratio} | {r.failovers} | {r.migrations} |"
        )
    return "\n".join(lines)
