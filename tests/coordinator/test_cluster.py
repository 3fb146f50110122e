"""Coordinator replicas over a NATS JetStream event log, with real processes.

The module shares one 3-node NATS cluster on free loopback ports (JetStream takes ~2 s
to elect its meta leader after the nodes start: paid once), each test with an event-log
stream (replicas 3) and snapshot bucket of its own on it, and the test that takes a node
down with a cluster of its own; the tests start coordinator replicas with `--event-log`
and check what an operator relies on:
events taken by one replica are found by lookups on another; a replica killed with
SIGKILL mid-ingest and restarted loses nothing; ingest and lookups go on with one NATS
node down; replicas restarted from snapshots hold the same state; a replica that fell
behind the stream's retention rebuilds from a (shared) snapshot or refuses to start,
never silently missing events. "The same state" is checked against a single-process,
in-memory coordinator fed the same bodies in the same order: every replica answers a set
of lookups exactly as it does, and has the same key, placement and index counts.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from blend_wire import (
    BLEND_LOOKUP_PATH,
    EVENTS_PATH,
    INSTANCES_PATH,
    STATS_PATH,
    encode,
    encode_tokens,
    pack_kv_rank,
)
from coordinator_stub.launch.nats_process import NatsCluster, launch_nats_cluster
from coordinator_stub.launch.process import launch_coordinator, start_coordinator
from coordinator_stub.memory import TRIM_AFTER_BYTES
from helpers import wait_until

LANE = "nats"

CHUNK = 16
MODELS = ("m", "n")
# Outcomes across processes (replicas, NATS): generous deadlines for a loaded machine.
settled = functools.partial(wait_until, timeout=60.0, interval=0.1)
# Every request of this module goes through this one client: `httpx.post(...)` and the like
# build a client, SSL context included (~45 ms here), per call, which once took most of
# these tests' time. No keep-alive: each request still opens its own connection, so none
# outlives the replica it went to (replicas are killed, and restarted on the same port).
# Shared by the threads that post and heartbeat (httpx's pool locks its state).
http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


@dataclass
class Cluster:
    """A NATS cluster and the event-log stream a test's replicas use on it (the snapshot
    bucket is named after it: `<stream>-snapshots`)."""

    nodes: NatsCluster
    stream: str

    @property
    def urls(self) -> str:
        return self.nodes.urls

    def url(self, node: int) -> str:
        return self.nodes.url(node)


@pytest.fixture(scope="module")
def shared_nats(tmp_path_factory):
    with launch_nats_cluster(3, tmp_path_factory.mktemp("nats")) as cluster:
        yield cluster


_streams = itertools.count(1)


@pytest.fixture
def nats(shared_nats):
    """The module's cluster, with a stream of this test's own (a name no other test used)."""
    assert all(p is not None and p.poll() is None for p in shared_nats.processes), \
        "a node of the shared cluster is down"
    return Cluster(shared_nats, f"blend-test-{next(_streams)}")


@pytest.fixture
def own_nats(tmp_path):
    """A cluster for this test alone (it takes a node down)."""
    with launch_nats_cluster(3, tmp_path / "nats") as cluster:
        yield Cluster(cluster, "blend-test")


def replica_flags(nats: Cluster, *extra: str, stream: str | None = None) -> tuple[str, ...]:
    # No reaper unless a test asks for one (a later --health-check-interval wins): these
    # emitters never register, so one fenced and holding nothing is an id a reaper tick
    # appends a `reap` record for, among the records a test counts (a tick falls inside
    # a test whenever it runs past the 10 s interval, as on a loaded machine).
    return ("--enable-blend-lookup", "--chunk-size", str(CHUNK), "--event-log", nats.urls,
            "--event-log-stream", stream or nats.stream, "--event-log-replicas", "3",
            "--health-check-interval", "0", *extra)


def start_replicas(*flag_sets: tuple[str, ...]):
    """Start several coordinators at once (each takes a few seconds to load kernels)."""
    with ThreadPoolExecutor(len(flag_sets)) as pool:
        return list(pool.map(lambda flags: start_coordinator(*flags), flag_sets))


# --- a workload: bodies from several emitters, and lookups over what they stored --------


class Workload:
    """Deterministic store/delete/fence traffic from three emitters over two models."""

    def __init__(self, seed: int, chunks: int = 120) -> None:
        rng = random.Random(seed)
        self.contents = [[rng.randrange(50_000) for _ in range(CHUNK)] for _ in range(chunks)]
        self.rng = rng
        self.seqs: dict[str, int] = {}
        self.incarnations: dict[str, int] = {}

    def _batch(self, instance: str, event_type: str, entries: list[dict],
               tier: str = "l1") -> dict:
        self.seqs[instance] = self.seqs.get(instance, 0) + 1
        return {"instance_id": instance, "incarnation": self.incarnations.get(instance, 0),
                "seq": self.seqs[instance], "event_type": event_type, "tier": tier,
                "backend": "dram", "entries": entries}

    def _entry(self, i: int, model: str, with_tokens: bool = True) -> dict:
        key = {"chunk_hash_hex": f"{i:04x}{model.encode().hex()}", "model_name": model,
               "kv_rank": pack_kv_rank(1)}
        return {"key": key, "token_ids": self.contents[i] if with_tokens else [],
                "token_offset": CHUNK * (i % 7), "size_bytes": 100}

    def bodies(self, count: int) -> list[bytes]:
        rng, out = self.rng, []
        for n in range(count):
            instance = f"server-{rng.randrange(3)}"
            if n and n % 37 == 0:  # a restart: the next batch fences what it held
                self.incarnations[instance] = self.incarnations.get(instance, 0) + 1
                self.seqs[instance] = 0
            model = rng.choice(MODELS)
            picks = rng.sample(range(len(self.contents)), 4)
            if rng.random() < 0.2:
                batch = self._batch(instance, "delete",
                                    [self._entry(i, model, False) for i in picks])
            else:
                batch = self._batch(instance, "store",
                                    [self._entry(i, model, rng.random() < 0.9) for i in picks],
                                    tier=rng.choice(("l1", "l1", "l2")))
            out.append(encode({"batches": [batch]}))
        return out

    def queries(self) -> list[bytes]:
        rng, out = random.Random(7), []
        for _ in range(30):
            picks = rng.sample(self.contents, 5)
            tokens = [t for content in picks for t in [rng.randrange(9)] + content]
            for model in MODELS:
                out.append(encode({"tokens_b64": encode_tokens(tokens), "model_name": model}))
        return out


def post(url: str, body: bytes, timeout: float = 30.0) -> dict:
    """POST /events, retrying while the log is briefly unavailable (503), as a reporter
    would; a replica that is down raises."""
    deadline = time.monotonic() + timeout
    while True:
        reply = http.post(url + EVENTS_PATH, content=body, timeout=15)
        if reply.status_code != 503 or time.monotonic() > deadline:
            assert reply.status_code == 200, reply.text
            return reply.json()
        time.sleep(0.2)


def answers(url: str, queries: list[bytes]) -> list[list[dict]]:
    return [http.post(url + BLEND_LOOKUP_PATH, content=q, timeout=15).json()["matches"]
            for q in queries]


def state_of(url: str) -> dict:
    stats = http.get(url + STATS_PATH, timeout=15).json()
    return {"num_keys": stats["num_keys"], "num_placements": stats["num_placements"],
            **{k: stats["blend"][k] for k in ("num_contents", "num_chunks", "num_claims",
                                              "num_namespaces")}}


def replica_stats(url: str) -> dict:
    return http.get(url + STATS_PATH, timeout=15).json()["replica"]


#: A single in-memory coordinator: fed the same bodies in the same order, it is what every
#: replica must match.
REFERENCE = ("--enable-blend-lookup", "--chunk-size", str(CHUNK))


def feed(reference, bodies: list[bytes]):
    for body in bodies:
        post(reference.url, body)
    return reference


def assert_same_as(reference_url: str, urls: list[str], queries: list[bytes]) -> None:
    expected = answers(reference_url, queries)
    assert sum(len(m) for m in expected) > 20, "the queries should find plenty"
    expected_state = state_of(reference_url)
    for url in urls:
        assert answers(url, queries) == expected, url
        assert state_of(url) == expected_state, url


# --- the tests -----------------------------------------------------------------------------


def test_events_posted_to_one_replica_are_found_by_lookups_on_another(nats):
    workload = Workload(seed=1)
    bodies = workload.bodies(60)
    a, b, reference = start_replicas(replica_flags(nats, "--replica-name", "a"),
                                     replica_flags(nats, "--replica-name", "b"), REFERENCE)
    feed(reference, bodies)
    try:
        # A malformed body is refused whole (422) and appends nothing.
        bad = encode({"batches": [{"instance_id": "s", "seq": 0, "event_type": "store",
                                   "tier": "l1", "backend": "dram", "entries": []}]})
        reply = http.post(a.url + EVENTS_PATH, content=bad, timeout=10)
        assert reply.status_code == 422 and "seq" in reply.text
        assert replica_stats(a.url)["applied_seq"] == 0
        for i, body in enumerate(bodies):
            reply = post((a if i % 2 else b).url, body)
            # The reply comes after the append is acknowledged and applied here.
            assert reply["applied"] + reply["duplicates"] + reply["stale"] == 1
        assert replica_stats(a.url)["applied_seq"] == 60
        wait_applied(b.url, 60)
        assert_same_as(reference.url, [a.url, b.url], workload.queries())
        # An instance leaving (DELETE, or the reaper) goes through the log too: every
        # replica fences its L1 placements at the same point of the stream.
        for url in (a.url, reference.url):
            assert http.delete(f"{url}/instances/server-1", timeout=10).status_code == 204
        wait_applied(b.url, 61)
        stats = http.get(b.url + STATS_PATH, timeout=10).json()
        assert "server-1" not in stats["l1_keys_by_instance"]
        assert_same_as(reference.url, [a.url, b.url], workload.queries())
    finally:
        for running in (a, b, reference):
            running.stop()


def test_a_replica_gives_back_the_memory_of_a_burst_of_records_it_applied(nats):
    # A burst posted to one replica: the other applies the same records from the log, and
    # gives their memory back once the burst is over, as the first does after the bodies.
    workload = Workload(seed=2, chunks=8000)
    entries = [workload._entry(i, MODELS[0]) for i in range(8000)]
    bodies = [encode({"batches": [workload._batch("server-0", "store",
                                                  entries[i:i + 500])]})
              for i in range(0, 8000, 500)]
    assert sum(map(len, bodies)) >= 1.5 * TRIM_AFTER_BYTES
    a, b = start_replicas(replica_flags(nats, "--replica-name", "a"),
                          replica_flags(nats, "--replica-name", "b"))
    try:
        assert replica_stats(b.url)["memory_given_back"] == 0
        for body in bodies:
            post(a.url, body)
        wait_applied(b.url, len(bodies))
        wait_until(lambda: replica_stats(b.url)["memory_given_back"] == 1, timeout=10)
        time.sleep(0.3)  # once per burst
        assert replica_stats(b.url)["memory_given_back"] == 1
    finally:
        for running in (a, b):
            running.stop()


def wait_applied(url: str, seq: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while replica_stats(url)["applied_seq"] < seq and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replica_stats(url)["applied_seq"] >= seq


def test_replica_killed_mid_ingest_restarts_from_its_snapshot_and_loses_nothing(nats, tmp_path):
    workload = Workload(seed=2)
    bodies = workload.bodies(240)
    flags_b = replica_flags(nats, "--replica-name", "b", "--snapshot-dir",
                            str(tmp_path / "snap-b"), "--snapshot-interval", "0.5")
    a, b, reference = start_replicas(replica_flags(nats, "--replica-name", "a"), flags_b,
                                     REFERENCE)
    feed(reference, bodies)
    try:
        killed = threading.Event()
        # The writer holds its second half until b has a snapshot to restart from, and the
        # kill follows at once: ~120 posts still to go when it lands, however fast they are.
        kill_due = threading.Event()
        posted = 0

        def ingest() -> None:
            nonlocal posted
            for i, body in enumerate(bodies):
                if i == 120:
                    kill_due.wait(30)
                target = b if i % 2 and not killed.is_set() else a
                try:
                    post(target.url, body)
                except httpx.TransportError:  # b died under us: send it to a instead
                    post(a.url, body)
                posted = i + 1

        writer = threading.Thread(target=ingest)
        writer.start()
        deadline = time.monotonic() + 30
        while (replica_stats(b.url)["snapshot_seq"] == 0 or posted < 120) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        kill_due.set()
        assert posted < len(bodies), "the kill should land mid-ingest"
        b.process.kill()  # SIGKILL: no final snapshot, nothing flushed
        killed.set()
        b.process.wait()
        writer.join()
        b = start_coordinator(*flags_b)
        restored = replica_stats(b.url)
        assert restored["restored_from_seq"] > 0, "it should start from its snapshot"
        assert restored["applied_seq"] == replica_stats(a.url)["applied_seq"] >= len(bodies)
        assert_same_as(reference.url, [a.url, b.url], workload.queries())
    finally:
        for running in (a, b, reference):
            running.stop()


def test_ingest_and_lookups_go_on_with_one_nats_node_down(own_nats):
    nats = own_nats
    workload = Workload(seed=3)
    bodies = workload.bodies(80)
    a, b, reference = start_replicas(replica_flags(nats, "--replica-name", "a"),
                                     replica_flags(nats, "--replica-name", "b"), REFERENCE)
    feed(reference, bodies)
    try:
        for body in bodies[:40]:
            post(a.url, body)
        nats.nodes.stop_node(0)
        for i, body in enumerate(bodies[40:]):
            post((a if i % 2 else b).url, body)
        wait_applied(a.url, 80)
        wait_applied(b.url, 80)
        assert_same_as(reference.url, [a.url, b.url], workload.queries())
    finally:
        for running in (a, b, reference):
            running.stop()


def test_every_replica_restarted_from_snapshots_holds_the_same_state(nats, tmp_path):
    workload = Workload(seed=4)
    bodies = workload.bodies(100)
    flag_sets = [replica_flags(nats, "--replica-name", name, "--snapshot-dir",
                               str(tmp_path / f"snap-{name}")) for name in ("a", "b")]
    *replicas, reference = start_replicas(*flag_sets, REFERENCE)
    feed(reference, bodies)
    try:
        for i, body in enumerate(bodies):
            post(replicas[i % 2].url, body)
        queries = workload.queries()
        before = answers(replicas[0].url, queries)
        for running in replicas:
            assert running.stop() == 0  # SIGTERM: a snapshot on the way out
        # A corrupt newest snapshot is refused; the replica falls back to the stream.
        newest_b = sorted((tmp_path / "snap-b").glob("snapshot-*"))[-1]
        newest_b.write_bytes(newest_b.read_bytes()[:-10] + b"0123456789")
        replicas = start_replicas(*flag_sets)
        a_stats, b_stats = (replica_stats(r.url) for r in replicas)
        assert a_stats["restored_from_seq"] == a_stats["applied_seq"] == 100
        assert b_stats["restored_from_seq"] == 0 and b_stats["applied_seq"] == 100
        assert answers(replicas[1].url, queries) == before
        assert_same_as(reference.url, [r.url for r in replicas], queries)
    finally:
        for running in (*replicas, reference):
            running.stop()


def test_a_replica_behind_the_retention_rebuilds_from_a_shared_snapshot(nats, tmp_path):
    """Stream keeps 30 records. b stops at record 10; a goes on to 80 and snapshots into
    the directory both share: b restarts from a's snapshot. With only its own old
    snapshot, a replica refuses to start and says which records are gone."""
    workload = Workload(seed=5)
    bodies = workload.bodies(80)
    shared = tmp_path / "shared"
    flags = [replica_flags(nats, "--replica-name", name, "--event-log-max-msgs", "30",
                           "--snapshot-dir", str(directory), "--snapshot-interval", "0.3")
             for name, directory in (("a", shared), ("b", shared),
                                     ("c", tmp_path / "own-c"))]
    a, b, c, reference = start_replicas(*flags, REFERENCE)
    feed(reference, bodies)
    try:
        for body in bodies[:10]:
            post(a.url, body)
        for running in (b, c):
            wait_applied(running.url, 10)
            assert running.stop() == 0
        for body in bodies[10:]:
            post(a.url, body)
        deadline = time.monotonic() + 10
        while replica_stats(a.url)["snapshot_seq"] < 80 and time.monotonic() < deadline:
            time.sleep(0.05)
        b = start_coordinator(*flags[1])
        assert replica_stats(b.url)["restored_from_seq"] >= 51
        assert_same_as(reference.url, [a.url, b.url], workload.queries())
        refused = subprocess.run(
            [sys.executable, "-m", "coordinator_stub", "--port", "0", *flags[2]],
            capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0
        assert "are gone" in refused.stderr and "snapshot" in refused.stderr
    finally:
        for running in (a, b, c, reference):
            running.stop()


def test_a_replica_paused_past_the_retention_reloads_a_shared_snapshot_or_stops(nats, tmp_path):
    """While running: the stream keeps 30 records; b (sharing a's snapshot directory) and
    c (a directory of its own) are frozen with SIGSTOP at record 10 while a takes 70
    more. Resumed, b finds its next record gone, reloads a's snapshot covering the gap
    and answers every lookup (and lists the same instances) as a single in-memory
    coordinator fed the same bodies; c has no snapshot covering the gap: it exits 1,
    naming the records it lost, and writes no snapshot of the state missing them."""
    workload = Workload(seed=7)
    bodies = workload.bodies(80)
    shared = tmp_path / "shared"
    flags = [replica_flags(nats, "--replica-name", name, "--event-log-max-msgs", "30",
                           "--snapshot-dir", str(directory), "--snapshot-interval", "0.3")
             for name, directory in (("a", shared), ("b", shared),
                                     ("c", tmp_path / "own-c"))]
    c_log = tmp_path / "c.log"
    a, b, reference = start_replicas(flags[0], flags[1], REFERENCE)
    with open(c_log, "w") as c_stderr:
        c = start_coordinator(*flags[2], stderr=c_stderr)
    feed(reference, bodies)
    try:
        register(a.url, "server-0", 8000)
        for body in bodies[:10]:
            post(a.url, body)
        for running in (b, c):
            wait_applied(running.url, 11)
        assert settled(lambda: replica_stats(c.url)["snapshot_seq"] >= 11), "c's own snapshot"
        for running in (b, c):
            running.process.send_signal(signal.SIGSTOP)
        time.sleep(2)  # their pending fetches expire: nothing more is handed to them
        for body in bodies[10:]:
            post(a.url, body)
        assert settled(lambda: replica_stats(a.url)["snapshot_seq"] >= 81), "a's snapshot"
        for running in (b, c):
            running.process.send_signal(signal.SIGCONT)

        assert c.process.wait(timeout=120) == 1
        said = c_log.read_text()
        assert "cannot continue without missing events" in said and "are gone" in said
        assert not [p for p in (tmp_path / "own-c").glob("snapshot-*")
                    if int(p.name.split("-")[1]) > 11], "c snapshotted a state with a gap"

        wait_applied(b.url, 81, timeout=60)
        assert replica_stats(b.url)["restored_from_seq"] >= 51
        assert_same_as(reference.url, [a.url, b.url], workload.queries())
        assert listing(b.url) == listing(a.url) != []
    finally:
        for running in (a, b, c, reference):
            if running.process.poll() is None:
                running.process.send_signal(signal.SIGCONT)
            running.stop()


@pytest.mark.coordinator
def test_bad_event_log_flags_are_refused_at_start():
    result = subprocess.run([sys.executable, "-m", "coordinator_stub", "--event-log",
                             "http://127.0.0.1:4222"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "nats://" in result.stderr


def test_the_log_reader_never_skips_records_retention_removed(tmp_path):
    """A reader that needs records the stream no longer holds gets `LogGap` (the replica
    then reloads a snapshot or stops), never the next record as if nothing was missing."""
    from coordinator_stub.durability.eventlog import EventLog, LogGap, LogSettings

    async def scenario(url: str) -> None:
        log = EventLog(LogSettings(servers=(url,), stream="gap", max_msgs=5))
        await log.open()
        try:
            for i in range(12):
                assert await log.append("events", b"{}", f"r{i}") == i + 1
            assert await log.bounds() == (8, 12)
            records = log.read_from(9)  # still held: read in order
            assert [r.seq for r in await records.__anext__()] == [9, 10, 11, 12]
            await records.aclose()
            with pytest.raises(LogGap) as gap:  # not records 8.. as if 3..7 never were
                await asyncio.wait_for(log.read_from(3).__anext__(), 10)
            assert (gap.value.expected, gap.value.found) == (3, 8)
            assert "3..7" in str(gap.value)
        finally:
            await log.close()

    with launch_nats_cluster(1, tmp_path / "nats") as single:
        asyncio.run(scenario(single.url(0)))


def test_the_log_reader_replays_large_records_in_order(tmp_path):
    """Records of large `/events` bodies (~1 MB each, 150 MB in all) are read back whole
    and in order: fetches are sized so the server never cuts the reader off as a slow
    consumer (which once stalled a replica replaying 200k chunks)."""
    from coordinator_stub.durability.eventlog import EventLog, LogSettings

    payload = b"x" * (1 << 20)

    async def scenario(url: str) -> None:
        log = EventLog(LogSettings(servers=(url,), stream="large", max_bytes=0))
        await log.open()
        try:
            for i in range(150):
                await log.append("events", payload, f"r{i}")
            seen = []
            async with asyncio.timeout(60):
                async for records in log.read_from(1):
                    seen += [r.seq for r in records if r.payload == payload]
                    if len(seen) >= 150:
                        break
            assert seen == list(range(1, 151))
        finally:
            await log.close()

    with launch_nats_cluster(1, tmp_path / "nats") as single:
        asyncio.run(scenario(single.url(0)))


def copy_object_damaged(url: str, bucket: str, name: str, copy: str) -> None:
    """Put a copy of object `name` with one byte near its end altered, named `copy`, as a
    peer whose snapshot was damaged on its way in would."""
    import nats as nats_client

    async def scenario() -> None:
        connection = await nats_client.connect(url)
        try:
            store = await connection.jetstream(timeout=30).object_store(bucket)
            data = bytearray((await store.get(name)).data)
            data[-3] ^= 0xFF
            await store.put(copy, bytes(data))
        finally:
            await connection.close()

    asyncio.run(scenario())


def test_a_fresh_replica_starts_from_a_peers_snapshot_in_the_object_store(nats, tmp_path):
    """a keeps its snapshots only in the NATS object store; c starts later with an empty
    disk and no snapshot of its own: it loads a's (refusing a corrupt newer object, with
    its reason), replays only the records after it, and answers like the reference."""
    workload = Workload(seed=6)
    bodies = workload.bodies(80)
    store_flags = ("--snapshot-store", "nats", "--snapshot-interval", "3600")
    a, b, reference = start_replicas(replica_flags(nats, "--replica-name", "a", *store_flags),
                                     replica_flags(nats, "--replica-name", "b"), REFERENCE)
    feed(reference, bodies)
    c = None
    try:
        for i, body in enumerate(bodies[:60]):
            post((a if i % 2 else b).url, body)
        assert a.stop() == 0  # SIGTERM: its snapshot (record 60) goes to the bucket
        for body in bodies[60:]:
            post(b.url, body)
        # A peer's newer snapshot, damaged on its way in: refused, never loaded.
        assert not list(tmp_path.glob("**/*.blendsnap")), "nothing on local disk"
        bucket = f"{nats.stream}-snapshots"
        copy_object_damaged(nats.url(0), bucket, "snapshot-00000000000000000060-a.blendsnap",
                            "snapshot-00000000000000000070-x.blendsnap")
        log_path = tmp_path / "c.log"
        with open(log_path, "w") as log_file:
            c = start_coordinator(*replica_flags(nats, "--replica-name", "c", *store_flags),
                                  stderr=log_file)
        stats = replica_stats(c.url)
        assert stats["restored_from_seq"] == 60 and stats["applied_seq"] == 80
        assert stats["replayed_records"] == 20
        log_text = log_path.read_text()
        assert (f"nats://{bucket}/snapshot-00000000000000000070-x.blendsnap refused: "
                "checksum mismatch (corrupt)") in log_text
        assert_same_as(reference.url, [b.url, c.url], workload.queries())
    finally:
        for running in (a, b, c, reference):
            if running is not None:
                running.stop()


def test_the_snapshot_bucket_keeps_the_newest_and_refuses_damaged_objects(tmp_path):
    """Uploads keep the newest `keep` objects; a download is byte for byte what was
    uploaded; an object whose bytes were altered is refused by the snapshot checksum."""
    from coordinator_stub.directory import KeyDirectory
    from coordinator_stub.durability.snapshot_format import SnapshotDir, SnapshotRefused, read
    from coordinator_stub.durability.snapshot_stores import SnapshotBucket, Snapshots

    import nats as nats_client

    directory = KeyDirectory(chunk_size=CHUNK, enable_blend_lookup=True)
    local = SnapshotDir(tmp_path / "local", keep=10)
    files = [local.save({"directory": directory}, {"seq": seq, "replica": "r"})
             for seq in range(1, 6)]

    async def scenario(url: str) -> None:
        connection = await nats_client.connect(url)
        try:
            js = connection.jetstream(timeout=30)
            bucket = await SnapshotBucket.open(js, "snaps", 1, 2, connection.max_payload)
            for path in files:
                await bucket.put(path)
            assert await bucket.names() == [files[4].name, files[3].name]
            # Pruned objects leave nothing listed behind (their tombstones are purged).
            info = await js.stream_info("OBJ_snaps", subjects_filter="$O.snaps.M.>")
            assert len(info.state.subjects) == 2
            fetched = tmp_path / "fetched"
            await bucket.fetch(files[4].name, fetched)
            assert fetched.read_bytes() == files[4].read_bytes()
            with pytest.raises(FileNotFoundError):  # pruned
                await bucket.fetch(files[0].name, fetched)
            damaged = bytearray(files[4].read_bytes())
            damaged[-5] ^= 0xFF
            await bucket.store.put(files[4].name, bytes(damaged))
            await bucket.fetch(files[4].name, fetched)
            with pytest.raises(SnapshotRefused, match="checksum mismatch"):
                read(fetched, {})
            # Through `Snapshots`: the damaged newest is passed over for the one before.
            snapshots = Snapshots("", bucket, keep=2)

            async def run(fn, *args):
                return fn(*args)

            try:
                state, meta = await snapshots.load_newest({}, run)
            finally:
                snapshots.close()
            assert meta["seq"] == 4 and isinstance(state["directory"], KeyDirectory)
        finally:
            await connection.close()

    with launch_nats_cluster(1, tmp_path / "nats") as single:
        asyncio.run(scenario(single.url(0)))


# --- the instance registry, replicated through the log ------------------------------------


def listing(url: str) -> list[dict]:
    return http.get(url + INSTANCES_PATH, timeout=15).json()["instances"]


def register(url: str, instance_id: str, port: int) -> dict:
    reply = http.post(url + INSTANCES_PATH, timeout=30,
                       json={"instance_id": instance_id, "ip": "127.0.0.1", "http_port": port})
    assert reply.status_code == 200, reply.text
    return reply.json()


def counters(url: str) -> dict:
    return http.get(url + STATS_PATH, timeout=15).json()["counters"]


def l1_instances(url: str) -> set[str]:
    return set(http.get(url + STATS_PATH, timeout=15).json()["l1_keys_by_instance"])


class Heartbeats:
    """What a registered server does: a heartbeat every `interval` s to one replica,
    moving to the next when it cannot be reached (or answers 5xx). Every answer's
    status is kept: a 404 would make the server re-register."""

    def __init__(self, instance_id: str, urls: list[str], interval: float = 0.3) -> None:
        self.instance_id, self.urls, self.interval = instance_id, urls, interval
        self.statuses: list[int] = []
        self.current = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def move_to(self, index: int) -> None:
        self.current = index

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for _ in range(len(self.urls)):
                url = self.urls[self.current]
                try:
                    reply = http.put(f"{url}{INSTANCES_PATH}/{self.instance_id}/heartbeat",
                                      timeout=10)
                except httpx.TransportError:
                    self.current = (self.current + 1) % len(self.urls)
                    continue
                if reply.status_code >= 500:
                    self.current = (self.current + 1) % len(self.urls)
                    continue
                self.statuses.append(reply.status_code)
                break

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        return self.statuses


def test_the_instance_registry_is_the_same_at_every_replica_and_outlives_restarts(nats, tmp_path):
    """Registrations, heartbeats, departures and reaping go through the log: `GET
    /instances` answers the same everywhere; a server whose heartbeats move to another
    replica keeps its registration; a silent one is reaped once, at one point of the
    log, though both replicas run a reaper; a replica restarted from its snapshot, or
    rebuilt from the stream alone, holds the same registry."""
    registry = ("--instance-timeout", "6", "--health-check-interval", "0.5")
    flags_a = replica_flags(nats, "--replica-name", "a", *registry)
    flags_b = replica_flags(nats, "--replica-name", "b", *registry, "--snapshot-dir",
                            str(tmp_path / "snap-b"))
    a, b = start_replicas(flags_a, flags_b)
    beats = None
    try:
        # Registered at a: b knows it at once (a heartbeat there is no 404).
        assert register(a.url, "kept", 8001) == {"instance_id": "kept", "re_registered": False}
        reply = http.put(f"{b.url}{INSTANCES_PATH}/kept/heartbeat", timeout=30)
        assert reply.status_code == 200, reply.text
        register(b.url, "silent", 8002)
        workload = Workload(seed=6)
        for instance in ("kept", "silent"):  # both hold L1 placements
            workload.seqs[instance] = 0
            batch = workload._batch(instance, "store", [workload._entry(i, "m") for i in
                                                        range(3)])
            post(b.url, encode({"batches": [batch]}))
        assert settled(lambda: listing(b.url) == listing(a.url) and len(listing(a.url)) == 2), \
            "both replicas list both instances"
        [kept_record, _] = listing(a.url)
        assert kept_record["instance_id"] == "kept"

        # kept heartbeats, first at b, then (b "fails") at a; silent says nothing.
        beats = Heartbeats("kept", [b.url, a.url])
        assert settled(lambda: len(beats.statuses) >= 5), "heartbeats at b"
        beats.move_to(1)
        assert settled(lambda: [i["instance_id"] for i in listing(a.url)] == ["kept"]), \
            "silent reaped at a"
        assert settled(lambda: [i["instance_id"] for i in listing(b.url)] == ["kept"]), \
            "silent reaped at b"
        # Reaped exactly once, at the same point: one drop on each replica, same state.
        for url in (a.url, b.url):
            assert counters(url)["instances_dropped"] == 1, url
            assert l1_instances(url) == {"kept"}, url
        assert state_of(a.url) == state_of(b.url)
        # kept: never told to re-register, never re-registered, never fenced.
        assert listing(a.url) == listing(b.url) == [kept_record]

        # b restarts from its snapshot; kept's heartbeats go on at a meanwhile.
        assert b.stop() == 0
        b = start_coordinator(*flags_b, port=b.port)  # the URL the server knows
        assert replica_stats(b.url)["restored_from_seq"] > 0
        assert listing(b.url) == [kept_record]
        beats.move_to(0)  # back to b: it still knows kept
        count = len(beats.statuses)
        assert settled(lambda: len(beats.statuses) >= count + 5), "heartbeats at restarted b"

        # a is rebuilt from the stream alone (SIGKILL, no snapshot): the same registry,
        # and the reap replayed at the same record, once.
        a.process.kill()
        a.process.wait()
        a = start_coordinator(*flags_a, port=a.port)
        assert settled(lambda: replica_stats(a.url)["applied_seq"]
                       >= replica_stats(b.url)["applied_seq"] - 5), "a caught up"
        assert listing(a.url) == [kept_record]
        assert counters(a.url)["instances_dropped"] == 1
        assert l1_instances(a.url) == {"kept"}
        assert set(beats.stop()) == {200}, "a heartbeat was refused: spurious re-registration"
        beats = None
        assert listing(a.url) == listing(b.url) == [kept_record]

        # A departure at one replica frees the instance's resources at both.
        assert http.delete(f"{b.url}{INSTANCES_PATH}/kept", timeout=30).status_code == 204
        assert settled(lambda: listing(a.url) == [] and l1_instances(a.url) == set()), \
            "kept gone at a"
        assert listing(b.url) == [] and l1_instances(b.url) == set()
        assert http.put(f"{a.url}{INSTANCES_PATH}/kept/heartbeat",
                         timeout=30).status_code == 404
    finally:
        if beats is not None:
            beats.stop()
        for running in (a, b):
            running.stop()
