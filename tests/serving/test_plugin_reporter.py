"""CacheEventReporter against real loopback servers: shapes, numbering, flushing, bounds."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from blend_wire import EventsRequest, WireError, decode, encode, pack_kv_rank
from helpers import (NOT_HUNG_S, HangingServer, LoopbackServer, Reply, TricklingServer,
                     closed_port_url, ok_reply, wait_until)
from plugin import BlendNamespace, CacheEventReporter

LANE = "unit"

NS = BlendNamespace("llama", "tenant-a", 4)
EVENTS = "/events"


def tok(*ids: int) -> np.ndarray:
    """One chunk's tokens as the plugin hands them over: a uint32 array."""
    return np.array(ids, dtype=np.uint32)


def reporter_for(url, **kwargs) -> CacheEventReporter:
    options = dict(instance_id="server-1", flush_interval=30.0, timeout=0.5)
    options.update(kwargs)
    return CacheEventReporter(url, **options)


def sent_batches(server) -> list[dict]:
    return [batch for body in server.bodies(EVENTS) for batch in body["batches"]]


def test_store_batches_carry_tokens_offsets_and_namespaced_keys():
    with LoopbackServer() as server:
        reporter = reporter_for(server.url)
        tokens = np.arange(8, dtype=np.uint32)
        reporter.report_store(NS, [b"\x01\x02", b"\xff"], [tokens[:4], tokens[4:]], [256, 260],
                              size_bytes=4096)
        assert reporter.flush()
        reporter.close()
        # What was sent is a valid EventsRequest by the shared wire contract.
        (path, body), = server.requests
        decode(body, EventsRequest)
        batch, = sent_batches(server)
        assert (batch["event_type"], batch["tier"], batch["backend"]) == ("store", "l1", "dram")
        first, second = batch["entries"]
        assert first["key"] == {"chunk_hash_hex": "0102", "model_name": "llama",
                                "kv_rank": pack_kv_rank(4), "object_group_id": 0,
                                "cache_salt": "tenant-a"}
        assert first["key"]["kv_rank"] >> 24 == 4  # the world size rides in the top byte
        assert (first["token_ids"], first["token_offset"], first["size_bytes"]) == ([0, 1, 2, 3], 256, 4096)
        assert (second["key"]["chunk_hash_hex"], second["token_ids"], second["token_offset"]) == \
            ("ff", [4, 5, 6, 7], 260)


def test_delete_batches_carry_keys_only():
    with LoopbackServer() as server:
        reporter = reporter_for(server.url)
        reporter.report_delete(NS, [b"\xab"])
        reporter.close()
        batch, = sent_batches(server)
        assert batch["event_type"] == "delete"
        entry, = batch["entries"]
        assert entry["key"]["chunk_hash_hex"] == "ab"
        assert entry["token_ids"] == []


def test_seq_counts_from_one_and_event_order_is_kept():
    with LoopbackServer() as server:
        reporter = reporter_for(server.url)
        chunk = [tok(0, 0, 0, 0)]
        reporter.report_store(NS, [b"\x01"], chunk, [0])
        reporter.report_delete(NS, [b"\x01"])
        reporter.report_store(NS, [b"\x02"], chunk, [0])
        reporter.flush()
        reporter.report_store(NS, [b"\x03"], chunk, [0])
        reporter.close()
        batches = sent_batches(server)
        assert [(b["seq"], b["event_type"], b["entries"][0]["key"]["chunk_hash_hex"]) for b in batches] == [
            (1, "store", "01"), (2, "delete", "01"), (3, "store", "02"), (4, "store", "03")]
        assert {(b["instance_id"], b["incarnation"]) for b in batches} == {
            ("server-1", reporter.incarnation)}


def test_each_event_carries_its_own_tier_and_backend():
    # A tier-aware host (LMCache's MP server) reports L1 and L2 placements of one chunk
    # separately; batches split where (type, tier, backend) changes, order kept.
    with LoopbackServer() as server:
        reporter = reporter_for(server.url)
        reporter.report_store(NS, [b"\x01"], [tok(0, 0, 0, 0)], [0])
        reporter.report_store(NS, [b"\x01"], [None], [-1], tier="l2", backend="fs")
        reporter.report_delete(NS, [b"\x01"], tier="l1", backend="dram")
        with pytest.raises(ValueError, match="tier"):
            reporter.report_delete(NS, [b"\x01"], tier="all")
        with pytest.raises(ValueError, match="backend"):
            reporter.report_store(NS, [b"\x01"], [tok(0, 0, 0, 0)], [0], backend="")
        reporter.close()
        assert [(b["seq"], b["event_type"], b["tier"], b["backend"])
                for b in sent_batches(server)] == [
            (1, "store", "l1", "dram"), (2, "store", "l2", "fs"), (3, "delete", "l1", "dram")]


def test_a_new_reporter_for_the_same_instance_has_a_higher_incarnation():
    url = closed_port_url()
    first = reporter_for(url, start=False)
    second = reporter_for(url, start=False)
    assert second.incarnation > first.incarnation >= time.time_ns() - 60 * 10**9


def test_flushes_in_the_background_every_interval():
    with LoopbackServer() as server:
        reporter = reporter_for(server.url, flush_interval=0.05)
        try:
            reporter.report_store(NS, [b"\x01"], [tok(1, 2)], [0])
            assert wait_until(lambda: len(sent_batches(server)) == 1, timeout=2.0)
            reporter.report_delete(NS, [b"\x01"])
            assert wait_until(lambda: len(sent_batches(server)) == 2, timeout=2.0)
        finally:
            reporter.close()


def test_close_flushes_what_is_queued():
    with LoopbackServer() as server:
        reporter = reporter_for(server.url, flush_interval=30.0)
        reporter.report_store(NS, [b"\x01"], [tok(1)], [0])
        assert server.requests == []
        reporter.close()
        assert len(sent_batches(server)) == 1
        assert not any(t.name.startswith("blend-events") and t.is_alive()
                       for t in threading.enumerate())


def test_the_store_path_only_enqueues():
    with HangingServer() as server:
        reporter = reporter_for(server.url, flush_interval=30.0, timeout=0.2)
        for i in range(200):
            reporter.report_store(NS, [bytes([i])], [np.arange(256, dtype=np.uint32)], [i * 256])
        # Structural: a hanging coordinator would block any call that touched the network.
        assert server.accepted == []  # nothing touched the network
        assert reporter.pending == 200
        reporter.close()


def test_a_bad_event_is_refused_when_queued_and_never_takes_the_queue_down():
    with LoopbackServer() as server:
        reporter = reporter_for(server.url)
        reporter.report_store(NS, [b"\x01"], [tok(1, 2)], [0])
        with pytest.raises(TypeError, match="str"):
            reporter.report_store(NS, ["01"], [tok(3)], [0])  # a hash must be bytes
        with pytest.raises(TypeError, match="int"):
            reporter.report_delete(NS, [b"\x02", 7])  # nothing of this call is queued
        with pytest.raises(WireError, match="world_size"):
            reporter.report_store(NS._replace(world_size=300), [b"\x03"], [tok(4)], [0])
        with pytest.raises(ValueError, match="token_offset"):
            reporter.report_store(NS, [b"\x04"], [tok(5)], [-5])
        reporter.report_delete(NS, [b"\x01"])
        assert reporter.pending == 2
        assert reporter.flush()
        reporter.close()
        assert [(b["event_type"], [e["key"]["chunk_hash_hex"] for e in b["entries"]])
                for b in sent_batches(server)] == [("store", ["01"]), ("delete", ["01"])]


def test_tokens_are_copied_when_queued():
    with LoopbackServer() as server:
        reporter = reporter_for(server.url)
        buffer = np.arange(8, dtype=np.uint32)  # the engine's buffer, reused after the call
        reporter.report_store(NS, [b"\x01", b"\x02"], [buffer[:4], buffer[4:]], [0, 4])
        buffer[:] = 99
        reporter.close()
        entries = [e for b in sent_batches(server) for e in b["entries"]]
        assert [e["token_ids"] for e in entries] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _block_batch_building(reporter):
    """Make the reporter's next batch build stop at its first entry until released."""
    building, release = threading.Event(), threading.Event()
    build_entry = reporter._entry

    def blocked_entry(event):
        building.set()
        assert release.wait(10.0)
        return build_entry(event)

    reporter._entry = blocked_entry
    return building, release


def test_the_store_path_never_waits_for_batch_building():
    with LoopbackServer() as server:
        reporter = reporter_for(server.url)
        chunk = np.arange(256, dtype=np.uint32)
        for i in range(100):
            reporter.report_store(NS, [bytes([i])], [chunk], [i])
        building, release = _block_batch_building(reporter)
        flusher = threading.Thread(target=reporter.flush)
        flusher.start()
        try:
            assert building.wait(10.0)
            # Mid-build: the queue's lock is free, so a store is queued without waiting.
            assert reporter._lock.acquire(blocking=False)
            reporter._lock.release()
            storer = threading.Thread(target=reporter.report_store,
                                      args=(NS, [b"\xff"], [chunk], [999]))
            storer.start()
            storer.join(10.0)
            assert not storer.is_alive()
            assert reporter.pending == 101  # the batch being built still counts
        finally:
            release.set()
            flusher.join(10.0)
        reporter.close()
        offsets = [e["token_offset"] for b in sent_batches(server) for e in b["entries"]]
        assert offsets == list(range(100)) + [999]  # nothing lost, order kept


def test_the_bound_applies_to_events_being_built_oldest_first():
    with LoopbackServer() as server:
        reporter = reporter_for(server.url, max_events=3)
        for i in range(3):
            reporter.report_store(NS, [bytes([i])], [tok(i)], [i])
        building, release = _block_batch_building(reporter)
        flusher = threading.Thread(target=reporter.flush)
        flusher.start()
        try:
            assert building.wait(10.0)
            for i in range(3, 5):  # two more than the bound: the two oldest go
                reporter.report_store(NS, [bytes([i])], [tok(i)], [i])
            assert reporter.pending == 3
        finally:
            release.set()
            flusher.join(10.0)
        reporter.close()
        offsets = [e["token_offset"] for b in sent_batches(server) for e in b["entries"]]
        assert offsets == [2, 3, 4]
        assert reporter.stats().dropped_events == 2


def test_bounded_queue_drops_oldest_and_counts_them():
    down = threading.Event()
    down.set()

    def behave(path, body):
        return Reply(500, "down") if down.is_set() else ok_reply(path, body)

    with LoopbackServer(behave) as server:
        reporter = reporter_for(server.url, max_events=5)
        for i in range(3):
            reporter.report_store(NS, [bytes([i])], [tok(i)], [i])
        assert not reporter.flush()  # coordinator down: kept, numbered
        for i in range(3, 8):
            reporter.report_store(NS, [bytes([i])], [tok(i)], [i])
        assert not reporter.flush()
        assert reporter.pending == 5
        assert reporter.stats().dropped_events == 3
        down.clear()
        assert reporter.flush()
        reporter.close()
        delivered = [e["token_offset"] for b in server.bodies(EVENTS)[-1]["batches"] for e in b["entries"]]
        assert delivered == [3, 4, 5, 6, 7]  # the newest five, in order
        # The batch built after the drops says so, cumulatively (LMCache 0.5.7's field).
        assert [b["dropped_events"] for b in server.bodies(EVENTS)[-1]["batches"]] == [3]


def test_failed_flush_is_retried_without_reordering():
    outcomes = iter([500, 500])

    def behave(path, body):
        status = next(outcomes, 200)
        return Reply(500, "down") if status != 200 else ok_reply(path, body)

    with LoopbackServer(behave) as server:
        reporter = reporter_for(server.url)
        reporter.report_store(NS, [b"\x0a"], [tok(1)], [0])
        assert not reporter.flush()
        reporter.report_delete(NS, [b"\x0a"])
        assert not reporter.flush()
        assert reporter.flush()
        reporter.close()
        attempts = [[(b["seq"], b["event_type"]) for b in body["batches"]] for body in server.bodies(EVENTS)]
        # The first batch keeps seq 1 on every retry, and the delete stays behind it.
        assert attempts == [[(1, "store")], [(1, "store"), (2, "delete")],
                            [(1, "store"), (2, "delete")]]
        assert reporter.stats().failed_flushes == 2


def test_rejected_batches_are_dropped_not_retried_forever(caplog):
    with LoopbackServer(lambda p, b: Reply(422, "seq: Expected int >= 1")) as server:
        reporter = reporter_for(server.url)
        reporter.report_store(NS, [b"\x01"], [tok(1)], [0])
        assert reporter.flush()
        assert reporter.pending == 0
        assert reporter.stats().rejected_batches == 1
        assert "rejected" in caplog.text
        reporter.close()


@pytest.mark.parametrize("status", [400, 413, 422])
def test_a_permanent_refusal_drops_only_the_refused_batch(status):
    """Every permanent refusal (plugin.http.PERMANENT_STATUSES) is handled alike: the post's
    batches are sent one by one, the refused one is dropped and counted, the others are
    delivered in order, and nothing is left to wedge the queue (a 413 used to be retried
    for ever; a 422 dropped every batch of its post)."""
    def behave(path, body):
        if any(batch["event_type"] == "delete" for batch in json.loads(body)["batches"]):
            return Reply(status, {"detail": "refused"})
        return ok_reply(path, body)

    with LoopbackServer(behave) as server:
        reporter = reporter_for(server.url)
        reporter.report_store(NS, [b"\x01"], [tok(1)], [0])
        reporter.report_delete(NS, [b"\x02"])
        reporter.report_store(NS, [b"\x03"], [tok(3)], [0])
        assert reporter.flush()
        stats = reporter.stats()
        assert (stats.pending, stats.rejected_batches, stats.sent_batches) == (0, 1, 2)
        assert stats.failed_flushes == 0
        posts = [[batch["seq"] for batch in body["batches"]] for body in server.bodies(EVENTS)]
        assert posts == [[1, 2, 3], [1], [2], [3]]
        reporter.close()


def test_unreachable_coordinator_never_raises_and_warns_once(caplog):
    reporter = reporter_for(closed_port_url())
    reporter.report_store(NS, [b"\x01"], [tok(1)], [0])
    assert not reporter.flush()
    assert not reporter.flush()
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "cannot deliver" in r.getMessage()]
    assert len(warnings) == 1
    reporter.close()


def test_a_store_without_tokens_is_sent_with_an_unknown_offset():
    with LoopbackServer() as server:
        reporter = reporter_for(server.url)
        reporter.report_store(NS, [b"\x01"], [None], [-1])  # tokens no longer held, offset unknown
        reporter.close()
        batch, = decode(server.requests[0][1], EventsRequest).batches
        assert (batch.event_type, batch.entries[0].key.chunk_hash_hex) == ("store", "01")
        assert len(batch.entries[0].token_ids) == 0 and batch.entries[0].token_offset == -1


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_trickling_coordinator_cannot_hold_flush_or_close_past_the_timeout(part):
    # httpx's timeouts are per read: a byte every 50 ms never trips a 0.3 s read timeout.
    budget = 0.3
    with TricklingServer(part, interval_s=0.05) as server:
        reporter = reporter_for(server.url, timeout=budget)
        reporter.report_store(NS, [b"\x01"], [np.arange(4, dtype=np.uint32)], [0])
        # Unbounded, a flush would last hours (1 MB at 20 bytes/s); bounded, the budget.
        started = time.monotonic()
        assert not reporter.flush()  # failed: the events stay queued
        assert time.monotonic() - started < NOT_HUNG_S
        assert reporter.pending == 1 and reporter.stats().failed_flushes == 1
        started = time.monotonic()
        reporter.close()  # its last flush is bounded the same way
        assert time.monotonic() - started < NOT_HUNG_S


def test_event_bodies_are_byte_for_byte_what_encoding_the_arrays_gives():
    # The reporter writes token lists with a kernel; the coordinator (ours or LMCache's)
    # must read exactly what encoding the entries' arrays with msgspec writes.
    rng = np.random.default_rng(7)
    with LoopbackServer() as server:
        reporter = reporter_for(server.url, max_entries_per_batch=5)
        reported = []
        for round_ in range(6):
            count = int(rng.integers(1, 9))
            hashes = [bytes([round_, i]) for i in range(count)]
            high = int(rng.choice([10, 130_000, 2**32]))
            chunks = [rng.integers(0, high, int(rng.integers(0, 300)), dtype=np.uint64)
                      .astype(np.uint32) for _ in hashes]
            chunks[0] = None if round_ == 3 else chunks[0]
            reporter.report_store(NS, hashes, chunks, [256 * i for i in range(count)])
            reported += [np.zeros(0, dtype=np.uint32) if c is None else c for c in chunks]
            if round_ % 2:
                reporter.report_delete(NS, hashes[:2])
        assert reporter.flush()
        reporter.close()
        sent = []
        for _, body in server.requests:
            request = decode(body, EventsRequest)  # token lists back as uint32 arrays
            assert encode(request) == body
            sent += [e.token_ids for b in request.batches if b.event_type == "store"
                     for e in b.entries]
        assert [s.tolist() for s in sent] == [r.tolist() for r in reported]
