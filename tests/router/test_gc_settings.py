"""The frontend's garbage-collector settings: pauses timed by generation, the freeze of what survives
a full collection (and the planned full collection over everything), the flags that set them, and a
real `globalrouter serve` that freezes at its start and exports what it froze."""

from __future__ import annotations

import gc
import re
import urllib.request
import weakref

import pytest

from globalrouter.cli import build_parser
from globalrouter.config import GcConfig, RouterConfig
from globalrouter.gc_pauses import GcPauses, apply_gc_settings
from globalrouter.serve_cli import router_config
from meshkit import settings
from meshkit.clock import FakeClock
from meshlaunch import free_port, process_group, wait_until
from meshlaunch.mesh import discovery_argv, router_argv

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def gc_state():
    """Leaves the process's collector as the test found it."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_pauses_are_timed_by_generation_and_reported_from_the_tick_not_the_collection(gc_state):
    seen: list[tuple[int, float]] = []
    pauses = GcPauses(lambda gen, s: seen.append((gen, s)))
    pauses.install()
    pauses.install()  # idempotent: one callback
    try:
        gc.collect(0)
        gc.collect(2)
        # Nothing observed inside a collection (it may start while this thread holds the
        # histogram's lock, in the metrics thread's scrape): queued for the loop's tick.
        assert seen == []
        assert pauses.tick() is None  # no refreeze: reports only
    finally:
        pauses.uninstall()
        pauses.uninstall()
    assert [g for g, _ in seen][-2:] == [0, 2] and all(s >= 0 for _, s in seen)
    n = len(seen)
    gc.collect(0)
    assert pauses.report() == 0 and len(seen) == n  # uninstalled


def test_what_survives_a_full_collection_is_frozen_and_a_planned_full_one_unfreezes(gc_state):
    clock = FakeClock()
    pauses = GcPauses(lambda gen, s: None, refreeze=True, full_every=600.0, clock=clock.monotonic)
    pauses.install()
    try:
        gc.unfreeze()
        assert pauses.tick() is None  # no full collection yet: nothing to freeze
        gc.collect(2)
        frozen = pauses.tick()
        assert frozen is not None and frozen == gc.get_freeze_count() > 0
        assert pauses.tick() is None  # once per full collection
        kept = [[i] for i in range(1000)]  # new long-lived objects: not frozen until the next one
        assert gc.get_freeze_count() == frozen
        clock.set(clock.monotonic() + 600.0)
        # The planned full collection: everything unfrozen, collected, the survivors frozen again.
        again = pauses.tick()
        assert again is not None and again >= frozen + len(kept)
    finally:
        pauses.uninstall()
    off = GcPauses(lambda gen, s: None)
    gc.collect(2)
    assert off.tick() is None  # without refreeze, nothing is frozen


def test_a_timed_young_collection_frees_young_cycles_and_freezes_what_survived(gc_state):
    """GcPauses.young (the loop's timer, GcConfig.young_every): a young collection, then with the
    freeze what survived it goes out of later passes, so no older generation fills up."""
    seen: list[tuple[int, float]] = []
    pauses = GcPauses(lambda gen, s: seen.append((gen, s)), refreeze=True)
    pauses.install()
    # No collection but the test's own: an automatic one could promote the cycle before young()
    # (it would then outlive a young collection) or report a young pause of its own.
    gc.disable()
    try:
        gc.unfreeze()
        gc.collect()
        frozen = gc.get_freeze_count()
        kept = [[i] for i in range(1000)]  # young and alive
        cycle: list[object] = []
        cycle.append(cycle)
        freed = _weak_target(cycle)
        del cycle  # young cyclic garbage: only a collection frees it
        pauses.report()
        seen.clear()
        pauses.young()
        assert freed() is None  # the cycle went
        assert gc.get_freeze_count() >= frozen + len(kept)  # what survived is frozen
        pauses.tick()
        assert any(g == 0 for g, _ in seen)  # its pause reported as a young one
        off = GcPauses(lambda gen, s: None)  # --no-gc-freeze: collected, not frozen
        gc.unfreeze()
        more = [[i] for i in range(1000)]  # young and alive: frozen only by a freeze
        off.young()
        assert gc.get_freeze_count() == 0
        del more
    finally:
        gc.enable()
        pauses.uninstall()


class _Cell(list):
    """A list that can be weakly referenced."""


def _weak_target(cycle: list) -> weakref.ref[_Cell]:
    cell = _Cell()
    cycle.append(cell)  # freed with the cycle
    return weakref.ref(cell)


def _config(*flags: str) -> GcConfig:
    args = settings.parse_args(build_parser(), ["serve", "--discovery", "h:1", *flags], environ={})
    args.security = RouterConfig().security
    return router_config(args).gc


def test_gc_flags_parse_into_the_config(gc_state):
    assert (
        _config()
        == GcConfig(freeze=True, full_every=600.0, threshold=0, young_every=0.05)
        == RouterConfig().gc
    )
    assert _config("--gc-young-every", "0") == GcConfig(young_every=0.0)
    with pytest.raises(ValueError, match="--gc-young-every"):
        GcConfig(young_every=-1.0)
    assert _config("--no-gc-freeze", "--gc-threshold", "5000", "--gc-full-every", "0") == GcConfig(
        freeze=False, full_every=0.0, threshold=5000
    )
    with pytest.raises(ValueError, match="--gc-threshold"):
        GcConfig(threshold=-1)
    with pytest.raises(ValueError, match="--gc-full-every"):
        GcConfig(full_every=float("inf"))
    apply_gc_settings(5000)
    assert gc.get_threshold()[0] == 5000
    before = gc.get_threshold()
    apply_gc_settings(0)  # 0 keeps what is set
    assert gc.get_threshold() == before


def test_the_generation_1_threshold_is_a_flag_and_applied(gc_state):
    assert RouterConfig().gc.threshold1 == 100  # a generation-1 pass a tenth as often as Python's
    assert _config("--gc-threshold1", "50") == GcConfig(threshold1=50)
    with pytest.raises(ValueError, match="--gc-threshold1"):
        GcConfig(threshold1=-1)
    young, _, oldest = gc.get_threshold()
    apply_gc_settings(0, 50)  # the young threshold kept, generation 1's set
    assert gc.get_threshold() == (young, 50, oldest)
    apply_gc_settings(0, 0)  # 0 keeps what is set
    assert gc.get_threshold() == (young, 50, oldest)


@pytest.mark.parametrize("flags, frozen", [((), True), (("--no-gc-freeze",), False)])
def test_a_served_frontend_freezes_at_its_start_and_exports_it(flags, frozen, tmp_path):
    with process_group(tmp_path) as group:
        discovery = f"127.0.0.1:{free_port()}"
        group.start("discovery", discovery_argv(discovery))
        address, metrics_port = f"127.0.0.1:{free_port()}", free_port()
        proc = group.start(
            "router",
            router_argv(address, discovery, "--metrics-listen", f"127.0.0.1:{metrics_port}", *flags),
        )
        text = ""

        def scraped() -> bool:
            nonlocal text
            proc.check_alive()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                return False
            return "globalrouter_gc_frozen_objects" in text

        wait_until(scraped, timeout=60)
        found = re.search(r"^globalrouter_gc_frozen_objects (\S+)$", text, re.M)
        assert found is not None, text
        value = float(found.group(1))
        assert (value > 1000) if frozen else (value == 0)
