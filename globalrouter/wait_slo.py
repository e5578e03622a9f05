"""Ranking under an operator's wait SLO: a convex wait cost whose price is found online.

The prefill weight trades cache hits against waiting: a high weight keeps a prefix's followers
on its holder through long queues, which is where most of the hits are and also where the tail
of the waits comes from. Under a wait SLO ("99% of requests should start within T seconds") the
ranking keeps a high prefill weight and adds a price per second of estimated wait beyond T:

    cost = prefill_weight * prefill left + wait + hotspot + excess_weight * max(0, wait - T)

so affinity wins until a queue approaches the SLO and the SLO wins after it. The price is the
Lagrange multiplier of the constraint "P(wait > T) <= 1 - quantile", found by dual ascent on the
decisions themselves: every decision observes the wait the frontend estimates at the pool it
ranked first, and the log of the price moves up by `step * quantile` when that estimate exceeds
T and down by `step * (1 - quantile)` otherwise; at equilibrium T is exceeded on a
`1 - quantile` share of decisions (where it can be kept at all). With late binding,
`SloController` also scales the dispatch queue's pool queue depth and hold by the wait quantile
observed over a sliding window of decisions (`--dispatch-slo-feedback`). Nothing here knows about
clocks or transport; the live frontend and the simulator share it.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass


def _target_problems(target_seconds: float, quantile: float, step: float) -> list[str]:
    """The checks WaitSlo and SloFeedback share: a positive target, a quantile in (0, 1), a positive step."""
    out = []
    if not (math.isfinite(target_seconds) and target_seconds > 0):
        out.append(f"target_seconds must be a positive number of seconds, got {target_seconds!r}")
    if not 0 < quantile < 1:
        out.append(f"quantile must be in (0, 1), got {quantile!r}")
    if not (math.isfinite(step) and step > 0):
        out.append(f"step must be positive, got {step!r}")
    return out


@dataclass(frozen=True, slots=True)
class WaitSlo:
    """The operator's wait objective and the bounds of its price."""

    target_seconds: float
    """The wait (seconds before a request starts at its pool, as the frontend estimates it)
    that at most a `1 - quantile` share of requests should exceed; also the knee of the cost."""
    quantile: float = 0.99
    """Share of decisions whose estimated wait should be within the target (0 < q < 1)."""
    prefill_weight: float = 5.0
    """The prefill weight under the SLO (instead of SelectionConfig.prefill_weight): as much
    affinity as pays in hits, since the wait price, not a low weight, guards the tail."""
    step: float = 0.1
    """Log-space step of the price per decision; larger adapts faster and wanders more."""
    min_excess_weight: float = 0.25
    """Lowest price of a second of wait beyond the target."""
    max_excess_weight: float = 32.0
    """Highest price (beyond it, moving a long prefix costs more than any queue saves)."""
    initial_excess_weight: float = 2.0
    """The price before any observation."""

    def problems(self) -> list[str]:
        """What is wrong with these values (empty when none), each naming the field."""
        out = _target_problems(self.target_seconds, self.quantile, self.step)
        if not (math.isfinite(self.prefill_weight) and self.prefill_weight > 0):
            out.append(f"prefill_weight must be positive, got {self.prefill_weight!r}")
        if not 0 < self.min_excess_weight <= self.max_excess_weight or not math.isfinite(
            self.max_excess_weight
        ):
            out.append(
                "excess weights must satisfy 0 < min_excess_weight <= max_excess_weight, got "
                f"{self.min_excess_weight!r}, {self.max_excess_weight!r}"
            )
        if not (math.isfinite(self.initial_excess_weight) and self.initial_excess_weight > 0):
            out.append(f"initial_excess_weight must be positive, got {self.initial_excess_weight!r}")
        return out


class WaitPrice:
    """The current price of a second of estimated wait beyond the SLO, moved by each decision."""

    __slots__ = ("_down", "_log", "_log_max", "_log_min", "_up", "excess_weight", "observations", "slo")

    def __init__(self, slo: WaitSlo) -> None:
        problems = slo.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.slo = slo
        self._log_min = math.log(slo.min_excess_weight)
        self._log_max = math.log(slo.max_excess_weight)
        self._up = slo.step * slo.quantile
        self._down = slo.step * (1.0 - slo.quantile)
        self._log = min(self._log_max, max(self._log_min, math.log(slo.initial_excess_weight)))
        self.excess_weight = math.exp(self._log)
        """The price the next decision uses."""
        self.observations = 0

    def observe(self, estimated_wait: float) -> None:
        """One decision's estimated wait (seconds) at the pool it ranked first."""
        self.observations += 1
        if estimated_wait > self.slo.target_seconds:
            lg = self._log + self._up
            if lg > self._log_max:
                lg = self._log_max
        else:
            lg = self._log - self._down
            if lg < self._log_min:
                lg = self._log_min
        self._log = lg
        self.excess_weight = math.exp(lg)


@dataclass(frozen=True, slots=True)
class SloFeedback:
    """Late binding under a wait SLO, held by feedback: the dispatch queue's per-pool queue depth
    and affinity hold are scaled by a factor that follows the observed wait quantile over a
    sliding window of the last decisions (`SloController`)."""

    target_seconds: float
    """The wait (arrival to start, the frontend's queue included) the quantile should meet."""
    quantile: float = 0.99
    """Which quantile of the waits (0 < q < 1)."""
    window: int = 512
    """Decisions whose observed waits are kept (the sliding window; bounds the memory)."""
    step: float = 0.1
    """Log-space step of the scale per decision, times how far (in log) the window's quantile is
    from the target (at most one step per decision either way)."""
    min_scale: float = 1.0
    """Lowest scale of the configured queue depth and hold."""
    max_scale: float = 64.0
    """Highest scale of the configured queue depth and hold."""

    def problems(self) -> list[str]:
        """What is wrong with these values (empty when none), each naming the field."""
        out = _target_problems(self.target_seconds, self.quantile, self.step)
        if not 1 <= self.window <= 65_536:
            out.append(f"window must be 1..65536 decisions, got {self.window!r}")
        if not (0 < self.min_scale <= 1 <= self.max_scale and math.isfinite(self.max_scale)):
            out.append(
                f"scales must satisfy 0 < min_scale <= 1 <= max_scale, got {self.min_scale!r}, {self.max_scale!r}"
            )
        return out


class SloController:
    """The scale of the dispatch queue's queue depth and hold, moved by each decision's observed
    wait: down while the window's quantile is over the target, up while it is under."""

    __slots__ = ("_log", "_log_max", "_log_min", "_order", "_recent", "feedback", "observations", "scale")

    def __init__(self, feedback: SloFeedback) -> None:
        problems = feedback.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.feedback = feedback
        self._log = 0.0
        self._log_min = math.log(feedback.min_scale)
        self._log_max = math.log(feedback.max_scale)
        self._recent: deque[float] = deque()
        """The window's waits in the order observed (at most `feedback.window`)."""
        self._order: list[float] = []
        """The same waits sorted (for the quantile)."""
        self.scale = 1.0
        """The factor the next decision applies to the queue depth and the hold."""
        self.observations = 0

    def window_quantile(self) -> float:
        """The quantile of the waits in the window (0 when empty)."""
        order = self._order
        if not order:
            return 0.0
        return order[min(len(order) - 1, int(self.feedback.quantile * len(order)))]

    def window_size(self) -> int:
        """Waits held (at most `feedback.window`)."""
        return len(self._recent)

    def observe(self, wait: float) -> None:
        """One decision's wait (seconds from arrival to its expected start at the chosen pool)."""
        fb = self.feedback
        self.observations += 1
        recent, order = self._recent, self._order
        if len(recent) >= fb.window:
            del order[bisect.bisect_left(order, recent.popleft())]
        recent.append(wait)
        bisect.insort(order, wait)
        q = self.window_quantile()
        # the error as a log ratio, at most one step a decision (a 0 quantile: far under)
        err = math.log(fb.target_seconds / q) if q > 0 else 1.0
        lg = self._log + fb.step * max(-1.0, min(1.0, err))
        self._log = lg = max(self._log_min, min(self._log_max, lg))
        self.scale = math.exp(lg)
