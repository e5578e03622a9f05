"""Limits: slots per identity and in total, byte-bounded caches, message caps per RPC kind."""

from __future__ import annotations

import pytest

from globaldiscovery.v1 import discovery_pb2 as dpb
from meshkit.limits import ByteBoundedCache, LimitExceeded, Slots, check_size, fitting, message_cap


def test_slots_bound_each_key_and_the_total_and_forget_idle_keys():
    slots = Slots("streams", per_key=2, total=3)
    slots.acquire("a")
    slots.acquire("a")
    with pytest.raises(LimitExceeded, match="a already has 2 streams open"):
        slots.acquire("a")
    slots.acquire("b")
    with pytest.raises(LimitExceeded, match="at most 3"):
        slots.acquire("c")
    slots.release("a")
    slots.release("a")
    slots.release("a")  # an extra release is harmless
    assert slots.in_use == 1 and set(slots._held) == {"b"}
    with slots.hold("c"):
        assert slots.in_use == 2
    assert slots.in_use == 1


def test_a_byte_bounded_cache_evicts_least_recently_used_by_size():
    cache: ByteBoundedCache[str, bytes] = ByteBoundedCache(100, lambda k, v: len(v))
    cache.put("a", b"x" * 40)
    cache.put("b", b"x" * 40)
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", b"x" * 40)
    assert cache.get("b") is None and cache.get("a") is not None and cache.bytes == 80
    cache.put("huge", b"x" * 101)
    assert cache.get("huge") is None and cache.bytes == 80
    cache.put("a", b"x" * 10)
    assert cache.bytes == 50 and len(cache) == 2


def test_message_caps_are_per_rpc_kind():
    assert message_cap("/globaldiscovery.v1.DiscoveryService/RegisterPool") == 256 * 1024
    assert message_cap("/poolrelay.v1.TelemetryService/PublishPoolTelemetry") == 1024 * 1024
    big = dpb.RegisterPoolRequest(pool_id="p", capabilities=["x" * 1000] * 300)
    with pytest.raises(LimitExceeded, match="accepts at most 262144"):
        check_size("/globaldiscovery.v1.DiscoveryService/RegisterPool", big)
    check_size("/globaldiscovery.v1.DiscoveryService/RegisterPool", dpb.RegisterPoolRequest(pool_id="p"))


def test_a_page_is_cut_by_bytes_but_always_holds_one_item():
    pools = [dpb.Pool(pool_id=f"p{i}", frontends=["http://h:1/" + "x" * 1000]) for i in range(10)]
    size = pools[0].ByteSize() + 8
    assert fitting(pools, budget=size * 3) == 3
    assert fitting(pools, budget=1) == 1
    assert fitting(pools) == 10
    assert fitting([]) == 0
