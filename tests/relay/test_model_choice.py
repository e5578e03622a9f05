"""The model-selection rules (DESIGN.md "Relay: what it registers and when") as a table."""

from __future__ import annotations

import pytest

from poolrelay.model_choice import ModelView, Reason, choose_model

R, N = True, False  # Ready, Not ready


def topo(**models: bool) -> list[ModelView]:
    return [ModelView(name.replace("_", "-"), ready) for name, ready in models.items()]


@pytest.mark.parametrize(
    ("case", "models", "registered", "reachable", "drained", "model", "reason"),
    [
        ("not read yet", None, None, True, False, None, Reason.NO_MODEL),
        ("empty topology", [], None, True, False, None, Reason.NO_MODEL),
        ("one ready", topo(a=R), None, True, False, "a", Reason.NONE),
        ("only model, not ready", topo(a=N), None, True, False, "a", Reason.NONE),
        ("one ready of two", topo(a=N, b=R), None, True, False, "b", Reason.NONE),
        ("two ready", topo(a=R, b=R), None, True, False, None, Reason.SEVERAL_MODELS),
        ("two, none ready", topo(a=N, b=N), None, True, False, None, Reason.SEVERAL_MODELS),
        (
            "keep registered though another is the one ready",
            topo(a=N, b=R),
            "a",
            True,
            False,
            "a",
            Reason.NONE,
        ),
        ("keep registered among several ready", topo(a=R, b=R), "b", True, False, "b", Reason.NONE),
        ("registered model gone, one ready left", topo(b=R, c=N), "a", True, False, "b", Reason.NONE),
        (
            "registered model gone, several left",
            topo(b=R, c=R),
            "a",
            True,
            False,
            None,
            Reason.SEVERAL_MODELS,
        ),
        ("registered model gone, nothing left", [], "a", True, False, None, Reason.NO_MODEL),
        ("pool unreachable", topo(a=R), "a", False, False, None, Reason.POOL_UNREACHABLE),
        ("pool drained", topo(a=R), "a", True, True, None, Reason.POOL_DRAINED),
    ],
)
def test_model_selection(case, models, registered, reachable, drained, model, reason):
    choice = choose_model(models, registered, reachable=reachable, drained=drained)
    assert (choice.model, choice.reason) == (model, reason), case
    if model is None:
        assert choice.detail, "a reason always comes with a sentence"


def test_several_models_detail_names_them():
    choice = choose_model(topo(alpha=R, beta=R), None)
    assert "alpha" in choice.detail and "beta" in choice.detail
