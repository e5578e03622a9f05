"""Which model the relay registers for its pool, and why it registers none (pure, no gRPC)."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class Reason(enum.IntEnum):
    """Why the pool is not registered; values equal poolrelay.v1.UnregisteredReason."""

    NONE = 0
    NO_MODEL = 1
    SEVERAL_MODELS = 2
    CALL_FAILED = 3
    RELAY_STOPPED = 4
    POOL_UNREACHABLE = 5
    POOL_DRAINED = 6


@dataclass(frozen=True)
class ModelView:
    """One model of the pool's topology as the relay sees it."""

    name: str
    """The model's name."""
    ready: bool
    """Whether the pool says it serves the model now."""


@dataclass(frozen=True)
class Choice:
    """The outcome of the selection: a model to register, or None with the reason and a sentence."""

    model: str | None
    """The model to register; None when nothing is registered."""
    reason: Reason = Reason.NONE
    """Why nothing is registered (NONE when a model is chosen)."""
    detail: str = ""
    """A sentence explaining the reason, naming the models seen."""


def choose_model(
    models: Iterable[ModelView] | None,
    registered: str | None,
    *,
    reachable: bool = True,
    drained: bool = False,
) -> Choice:
    """DESIGN.md "Relay: what it registers and when".

    Keep `registered` while it is in the topology in any state (so active-active replicas do not
    split between models); else the one Ready model; else the only model while none is Ready; else
    nothing. `models` None means the pool has not been read yet. An unreachable pool or a drained
    one has nothing to register, whatever its topology says.
    """
    if not reachable:
        return Choice(None, Reason.POOL_UNREACHABLE, "the pool's event stream is broken")
    if drained:
        return Choice(None, Reason.POOL_DRAINED, "the pool finished draining")
    if models is None:
        return Choice(None, Reason.NO_MODEL, "the pool's status has not been read yet")
    topology = list(models)
    names = sorted({m.name for m in topology})
    if registered is not None and registered in names:
        return Choice(registered)
    ready = sorted({m.name for m in topology if m.ready})
    if len(ready) == 1:
        return Choice(ready[0])
    if len(ready) > 1:
        return Choice(None, Reason.SEVERAL_MODELS, f"several models are Ready: {', '.join(ready)}")
    if len(names) == 1:
        return Choice(names[0])
    if not names:
        return Choice(None, Reason.NO_MODEL, "the pool's topology has no model")
    return Choice(None, Reason.SEVERAL_MODELS, f"several models and none is Ready: {', '.join(names)}")
