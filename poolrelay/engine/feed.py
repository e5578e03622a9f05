"""One worker's KV event feed: ZMQ SUB + replay, sequence tracking, gaps closed or the worker reset.

Soundness rests on one fact: applying any contiguous run of a worker's batches that ends at the
present, to an empty block set, yields only blocks the worker still holds (every removal after a
store is in the run). So on a gap the feed asks the replay socket for the missing batches; when
replay cannot close the gap (no replay socket, no answer, the engine's buffer no longer reaches
back), the worker's blocks are dropped and the feed starts again from what arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from meshkit.logs import get_logger
from poolrelay.engine.config import EngineWorker
from poolrelay.engine.events import Malformed, decode_batch
from poolrelay.engine.translate import Transition, WorkerBlocks

log = get_logger(module="poolrelay.engine.feed")

END_SEQ = -1
# At most this many replayed batches are taken from one replay (the engine's buffer is 10,000).
MAX_REPLAY_BATCHES = 100_000
SUB_HWM = 100_000
# Reasons and errors shown on the status are cut here: they may quote what an engine sent.
MAX_REASON_CHARS = 256


def clip(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """`text` cut to `limit` characters (an ellipsis says it was cut)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class FeedCounts:
    """What one worker's feed saw, for status and logs: fixed fields, nothing grows per batch."""

    batches: int = 0
    """Batches taken in sequence, live or replayed (undecodable ones too, skipped duplicates not)."""
    events: int = 0
    """Events in the decoded batches, applied to the worker's blocks."""
    malformed: int = 0
    """Messages dropped as not KV event batches: bad frames (event or replay socket), undecodable payloads."""
    gaps: int = 0
    replays: int = 0
    """Replays asked (at start, per gap, on a fresh start after a reset)."""
    replays_closed: int = 0
    """Replays answered and applied without dropping the worker's blocks."""
    replayed_batches: int = 0
    resets: int = 0
    last_reset_reason: str = ""
    duplicates: int = 0


def parse_frames(frames: list[bytes]) -> tuple[int, bytes]:
    """(sequence, payload) of a published message `[topic, seq (8 bytes, big-endian), payload]`."""
    if len(frames) != 3:
        raise Malformed(f"a published message has 3 frames (topic, seq, payload), got {len(frames)}")
    _topic, seq, payload = frames
    if len(seq) != 8:
        raise Malformed(f"the sequence frame has {len(seq)} bytes, not 8")
    return int.from_bytes(seq, "big"), payload


def parse_replay(frames: list[bytes]) -> tuple[int, bytes]:
    """(sequence, payload) of one replay reply on a DEALER: `["", [topic,] seq, payload]`; seq -1 ends."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise Malformed(f"a replay reply is ['', [topic,] seq, payload], got {len(frames)} frames")
    seq, payload = frames[-2], frames[-1]
    if len(seq) != 8:
        raise Malformed(f"the replay sequence frame has {len(seq)} bytes, not 8")
    return int.from_bytes(seq, "big", signed=True), payload


class WorkerFeed:
    """Applies one worker's batches in sequence; the transport calls `on_message`."""

    def __init__(
        self,
        worker: EngineWorker,
        blocks: WorkerBlocks,
        apply: Callable[[str, Transition], None],
        replay: Callable[[int], Awaitable[list[tuple[int, bytes]] | None]] | None = None,
    ) -> None:
        self.worker = worker
        self.blocks = blocks
        self._apply_transition = apply
        self._replay = replay
        self.last: int | None = None
        """The last sequence applied (None: nothing yet, or reset)."""
        self._dup_low = 0
        self._dup_high = -1
        """Sequences replayed ahead of the live socket: their live copies are skipped."""
        self.epoch = 0
        self.counts = FeedCounts()

    def reset(self, why: str) -> None:
        """Drops the worker's blocks and starts again from what arrives (a restart, a gap, a worker down)."""
        self.counts.resets += 1
        self.counts.last_reset_reason = clip(why)
        self.epoch += 1
        self.last = None
        self._dup_low, self._dup_high = 0, -1
        log.warning("engine worker blocks dropped", worker=self.worker.worker_id, reason=why)
        self._apply_transition(self.worker.worker_id, self.blocks.reset())

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last = seq
        self.counts.batches += 1
        try:
            batch = decode_batch(payload)
        except Malformed as exc:
            # A batch the relay cannot read may have removed blocks: it cannot vouch for any.
            self.counts.malformed += 1
            log.warning("malformed kv event batch", worker=self.worker.worker_id, seq=seq, error=str(exc))
            self.reset(f"batch {seq} could not be decoded")
            self.last = seq
            return
        self.counts.events += len(batch.events)
        self._apply_transition(self.worker.worker_id, self.blocks.apply(batch))

    async def on_message(self, seq: int, payload: bytes) -> None:
        """One live message."""
        last = self.last
        if last is not None and seq == last + 1:
            self._apply(seq, payload)
            return
        if last is not None and self._dup_low <= seq <= self._dup_high:
            self.counts.duplicates += 1
            return
        if last is not None and seq <= last:
            # The publisher's numbering went back: the engine restarted with an empty cache.
            self.reset(f"sequence went back from {last} to {seq} (engine restart)")
            last = None
        if last is None and seq == 0:
            self._apply(seq, payload)
            return
        want = 0 if last is None else last + 1
        if last is not None:
            self.counts.gaps += 1
            log.info("kv event gap; asking for replay", worker=self.worker.worker_id, want=want, got=seq)
        await self._recover(want, seq, payload)

    async def catch_up(self) -> None:
        """With nothing applied yet, takes what the engine still buffers (its recent history)."""
        if self.last is None and self._replay is not None:
            await self._recover(0, None, b"")

    async def _recover(self, want: int, seq: int | None, payload: bytes) -> None:
        """Replays from `want`, then applies a contiguous run ending at the present either way."""
        epoch = self.epoch
        replayed = None
        if self._replay is not None:
            self.counts.replays += 1
            replayed = await self._replay(want)
        if self.epoch != epoch:
            return  # reset meanwhile (worker down): what arrives next starts afresh
        self._take(want, replayed, seq, payload)
        if replayed is not None and self.epoch == epoch:
            # Answered, and nothing had to be dropped: the gap (or the fresh start) is closed.
            self.counts.replays_closed += 1

    def _take(
        self, want: int, replayed: list[tuple[int, bytes]] | None, seq: int | None, payload: bytes
    ) -> None:
        """Applies the replayed run from `want` and then the live message, resetting where they do not join."""
        run = [(s, p) for s, p in (replayed or ()) if s >= want]
        if (not run or run[0][0] != want) and self.last is not None:
            first = run[0][0] if run else None
            self.reset(f"replay could not close the gap from {want} (first replayed: {first})")
        self.counts.replayed_batches += len(run)
        for s, p in run:
            if self.last is not None and s != self.last + 1:
                self.reset(f"replay skipped from {self.last} to {s}")
            self._apply(s, p)
        if run:
            self._dup_low, self._dup_high = run[0][0], run[-1][0]
        if seq is None or (self.last is not None and seq <= self.last):
            return  # the live message was replayed too
        if self.last is not None and seq != self.last + 1:
            self.reset(f"replay ended at {self.last}, before live batch {seq}")
        # The live message follows the replayed run, or (nothing replayed) starts a fresh run.
        self._apply(seq, payload)


class ZmqWorkerTransport:
    """The SUB socket (and a DEALER for replay) of one worker, feeding a WorkerFeed."""

    def __init__(self, ctx: zmq.asyncio.Context, worker: EngineWorker, replay_timeout: float) -> None:
        self.ctx = ctx
        self.worker = worker
        self.replay_timeout = replay_timeout
        self.counts = FeedCounts()
        """Where dropped messages are counted: the fed WorkerFeed's counts once `run` starts."""
        self._dealer: zmq.asyncio.Socket | None = None

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    async def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The batches the engine still buffers from `start` on; None when it does not answer."""
        if self.worker.replay is None:
            return None
        if self._dealer is None:
            self._dealer = self.ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.worker.replay)
        dealer = self._dealer
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while len(out) < MAX_REPLAY_BATCHES:
                if not await dealer.poll(int(self.replay_timeout * 1000)):
                    raise TimeoutError
                try:
                    seq, payload = parse_replay(await dealer.recv_multipart())
                except Malformed as exc:
                    self.counts.malformed += 1
                    log.warning("malformed replay reply", worker=self.worker.worker_id, error=str(exc))
                    continue
                if seq == END_SEQ:
                    return out
                out.append((seq, payload))
            return out
        except (TimeoutError, zmq.ZMQError) as exc:
            # Late replies must not answer a later request: start that one on a fresh socket.
            self._close_dealer()
            log.warning("replay got no complete answer", worker=self.worker.worker_id, error=repr(exc))
            return None

    async def run(self, feed: WorkerFeed) -> None:
        """Reads the SUB socket until cancelled; malformed messages are counted, logged and skipped."""
        self.counts = feed.counts
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, SUB_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, self.worker.topic.encode())
        if self.worker.bind:
            sub.bind(self.worker.events)
        else:
            sub.connect(self.worker.events)
        try:
            await feed.catch_up()
            while True:
                frames = await sub.recv_multipart()
                try:
                    seq, payload = parse_frames(frames)
                except Malformed as exc:
                    feed.counts.malformed += 1
                    dropped = feed.counts.malformed
                    if dropped <= 10 or dropped % 1000 == 0:
                        log.warning(
                            "malformed kv event message",
                            worker=self.worker.worker_id,
                            error=str(exc),
                            count=dropped,
                        )
                    continue
                await feed.on_message(seq, payload)
        finally:
            sub.close(linger=0)
            self._close_dealer()


async def cancel_all(tasks: list[asyncio.Task]) -> None:
    """Cancels `tasks` and waits for them."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
