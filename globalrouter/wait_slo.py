"""Steering of the prefill weight toward an operator's wait SLO: a pure quantile tracker.

The prefill weight trades cache hits against waiting: a higher weight keeps a prefix's followers
on its holder through longer queues. Which weight is right depends on the traffic (how long the
prompts are, how bursty, how loaded), so an operator who states the wait they accept at a
quantile ("99% of requests start within 4 s") can let the frontend find it: every decision
observes the wait the frontend estimates at the pool it ranked first, and the weight moves by
stochastic quantile tracking in log space: down by `step * quantile` when the estimate exceeds
the target, up by `step * (1 - quantile)` otherwise. At equilibrium the target is exceeded on
a `1 - quantile` share of decisions; the weight stays within [min_weight, max_weight].
Nothing here knows about clocks or transport; the live frontend and the simulator share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WaitSlo:
    """The operator's wait objective and the steering's bounds."""

    target_seconds: float
    """The wait (seconds before a request starts at its pool, as the frontend estimates it)
    that at most a `1 - quantile` share of requests should exceed."""
    quantile: float = 0.99
    """Share of decisions whose estimated wait should be within the target (0 < q < 1)."""
    step: float = 0.1
    """Log-space step per decision; larger adapts faster and wanders more."""
    min_weight: float = 1.0
    """Lowest prefill weight (1: the request's own time only, as dynamo's cost)."""
    max_weight: float = 5.0
    """Highest prefill weight (affinity beyond this queues sessions behind their holder)."""
    initial_weight: float = 1.3
    """The weight before any observation (the fixed default's)."""

    def problems(self) -> list[str]:
        """What is wrong with these values (empty when none), each naming the field."""
        out = []
        if not (math.isfinite(self.target_seconds) and self.target_seconds > 0):
            out.append(f"target_seconds must be a positive number of seconds, got {self.target_seconds!r}")
        if not 0 < self.quantile < 1:
            out.append(f"quantile must be in (0, 1), got {self.quantile!r}")
        if not (math.isfinite(self.step) and self.step > 0):
            out.append(f"step must be positive, got {self.step!r}")
        if not 0 < self.min_weight <= self.max_weight or not math.isfinite(self.max_weight):
            out.append(
                f"weights must satisfy 0 < min_weight <= max_weight, got {self.min_weight!r}, {self.max_weight!r}"
            )
        return out


class PrefillWeightSteering:
    """The current prefill weight, moved by each observed estimated wait."""

    __slots__ = ("_down", "_log_max", "_log_min", "_log_weight", "_up", "observations", "slo", "weight")

    def __init__(self, slo: WaitSlo) -> None:
        problems = slo.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.slo = slo
        self._log_min = math.log(slo.min_weight)
        self._log_max = math.log(slo.max_weight)
        self._down = slo.step * slo.quantile
        self._up = slo.step * (1.0 - slo.quantile)
        self._log_weight = min(self._log_max, max(self._log_min, math.log(slo.initial_weight)))
        self.weight = math.exp(self._log_weight)
        """The prefill weight the next decision uses."""
        self.observations = 0

    def observe(self, estimated_wait: float) -> None:
        """One decision's estimated wait (seconds) at the pool it ranked first."""
        self.observations += 1
        if estimated_wait > self.slo.target_seconds:
            lw = self._log_weight - self._down
            if lw < self._log_min:
                lw = self._log_min
        else:
            lw = self._log_weight + self._up
            if lw > self._log_max:
                lw = self._log_max
        self._log_weight = lw
        self.weight = math.exp(lw)
