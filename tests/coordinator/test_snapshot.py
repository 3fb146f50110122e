"""Snapshots of a replica's state: exact round trip (across processes), and refusals.

A snapshot must bring back the very directory it was taken of, including what lookups
depend on beyond the set of chunks (which of several chunks holding the same content is
named first), in another process (whose per-process hash differs). A corrupt snapshot, a
newer format, another build's layout or another configuration is refused with a message
that says so, and the newest sound snapshot is used instead.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from blend_wire import BlendNamespace, EventsRequest, decode, encode, pack_kv_rank
from coordinator_stub.directory import KeyDirectory
from coordinator_stub.durability.snapshot_format import FORMAT, SnapshotDir, SnapshotRefused, layout_of, read

LANE = "unit"

C = 16
NS = BlendNamespace("m", "", 1)
CONTENT = list(range(100, 100 + C))


def store(directory: KeyDirectory, seq: int, chunk_hash: str, offset: int) -> None:
    key = {"chunk_hash_hex": chunk_hash, "model_name": "m", "kv_rank": pack_kv_rank(1)}
    batch = {"instance_id": "s", "seq": seq, "event_type": "store", "tier": "l1",
             "backend": "dram", "entries": [{"key": key, "token_ids": CONTENT,
                                             "token_offset": offset}]}
    directory.ingest(decode(encode({"batches": [batch]}), EventsRequest).batches)


def first_named(directory: KeyDirectory) -> bytes:
    return directory.match(np.array(CONTENT, dtype=np.uint32), NS)[0].chunk_hash


@pytest.mark.coordinator
def test_a_snapshot_written_by_another_process_restores_the_same_directory(tmp_path):
    # Two chunks hold one content: "aa" was claimed first, so a lookup names it first.
    tests_dir = str(Path(__file__).resolve().parent)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {tests_dir!r})
        from coordinator_stub.directory import KeyDirectory
        from coordinator_stub.durability.snapshot_format import SnapshotDir
        from test_snapshot import store
        directory = KeyDirectory(chunk_size={C}, enable_blend_lookup=True)
        store(directory, 1, "aa", 0)
        store(directory, 2, "bb", {C})
        SnapshotDir({str(tmp_path)!r}).save({{"directory": directory}}, {{"seq": 2}})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    state, meta = SnapshotDir(tmp_path).load_newest({})
    directory = state["directory"]
    assert meta["seq"] == 2 and first_named(directory) == b"\xaa"
    # Re-storing the same content at the same offset changes nothing (the content's digest
    # was recomputed with this process's hash): "aa" is still named first, not re-added
    # behind "bb".
    store(directory, 3, "aa", 0)
    assert first_named(directory) == b"\xaa"
    assert directory.stats()["blend"]["num_chunks"] == 2
    store(directory, 4, "cc", 2 * C)  # and it goes on ingesting
    assert directory.stats()["num_keys"] == 3


def saved(tmp_path, seq: int = 1, **meta) -> tuple[SnapshotDir, object]:
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    store(directory, 1, "aa", 0)
    snapshots = SnapshotDir(tmp_path)
    return snapshots, snapshots.save({"directory": directory},
                                     {"seq": seq, "chunk_size": C, **meta})


def test_a_corrupt_snapshot_is_refused_and_an_older_sound_one_is_used(tmp_path):
    snapshots, _ = saved(tmp_path, seq=1)
    _, newest = saved(tmp_path, seq=2)
    newest.write_bytes(newest.read_bytes()[:-3] + b"xyz")
    with pytest.raises(SnapshotRefused, match="corrupt"):
        read(newest, {})
    state, meta = snapshots.load_newest({"chunk_size": C})
    assert meta["seq"] == 1 and first_named(state["directory"]) == b"\xaa"


def test_a_truncated_or_foreign_file_is_refused_as_corrupt(tmp_path):
    _, path = saved(tmp_path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(SnapshotRefused, match="corrupt"):
        read(path, {})
    path.write_bytes(b"hello\n")
    with pytest.raises(SnapshotRefused, match="not a snapshot"):
        read(path, {})


def test_a_newer_format_is_refused_saying_so(tmp_path):
    _, path = saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data.replace(b"BLENDSNAP %d\n" % FORMAT, b"BLENDSNAP %d\n" % (FORMAT + 1),
                                  1))
    with pytest.raises(SnapshotRefused, match="newer"):
        read(path, {})


def test_another_layout_or_configuration_is_refused(tmp_path):
    layout = layout_of(KeyDirectory(chunk_size=C))
    _, path = saved(tmp_path, layout=layout)
    with pytest.raises(SnapshotRefused, match="layout"):
        read(path, {"layout": "0123456789abcdef"})
    with pytest.raises(SnapshotRefused, match="chunk_size"):
        read(path, {"chunk_size": 256})
    assert read(path, {"layout": layout, "chunk_size": C})[1]["seq"] == 1
    assert SnapshotDir(tmp_path).load_newest({"chunk_size": 256}) is None


def test_old_snapshots_are_pruned(tmp_path):
    for seq in range(1, 6):
        saved(tmp_path, seq=seq)
    assert [int(p.name.split("-")[1]) for p in SnapshotDir(tmp_path).files()] == [5, 4, 3]


def test_an_older_format_is_refused_saying_so(tmp_path):
    _, path = saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data.replace(b"BLENDSNAP %d\n" % FORMAT, b"BLENDSNAP %d\n" % (FORMAT - 1),
                                  1))
    with pytest.raises(SnapshotRefused, match="older"):
        read(path, {})


def test_a_snapshot_from_before_the_ingest_pipeline_still_ingests():
    # Until issue 34 the capacity table was a plain journaled dict; a snapshot holding one
    # has the same layout, so it is loaded, and its capacity rows take `config` batches.
    import pickle

    from coordinator_stub.directory.journal import JournaledDict

    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    directory._capacity = JournaledDict(directory._journal,  # noqa: SLF001 - an old state
                                        {("s", "l1", "dram"): (1 << 20, 1)})
    loaded = pickle.loads(pickle.dumps(directory))
    config = {"instance_id": "s", "seq": 1, "event_type": "config", "tier": "l1",
              "backend": "dram", "capacity_bytes": 2 << 20, "capacity_revision": 2}
    assert loaded.ingest(decode(encode({"batches": [config]}), EventsRequest).batches
                         ).applied == 1
    assert [(row["capacity_bytes"], row["capacity_revision"])
            for row in loaded.stats()["capacity"]] == [(2 << 20, 2)]
    loaded.drop_instance("s")
    assert loaded.stats()["capacity"] == []



def test_a_snapshot_from_before_the_head_table_still_matches_shared_contents():
    # Until issue 30's head table, the heads of a content's further claim lists were a
    # dict under the same attribute: same layout, so such a snapshot loads, converted.
    import pickle

    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    tokens = list(range(1, C + 1))
    entries = [{"key": {"chunk_hash_hex": "ab", "model_name": "m", "kv_rank": pack_kv_rank(1),
                        "cache_salt": salt}, "token_ids": tokens, "token_offset": 0}
               for salt in ("t0", "t1")]
    batch = {"instance_id": "i", "seq": 1, "event_type": "store", "tier": "l1",
             "backend": "dram", "entries": entries}
    directory.ingest(decode(encode({"batches": [batch]}), EventsRequest).batches)
    claims = directory._index._claims  # noqa: SLF001 - an old state
    assert len(claims.other_heads) == 1
    claims._more_heads = dict(claims.other_heads.items())  # noqa: SLF001
    loaded = pickle.loads(pickle.dumps(directory))
    query = np.array([0] + tokens, dtype=np.uint32)
    for salt in ("t0", "t1"):
        found = loaded.match(query, BlendNamespace("m", salt, 1))
        assert [(m.chunk_hash, m.cur_st) for m in found] == [(bytes.fromhex("ab"), 1)]
