"""Snapshots a crash or a bad header left behind (issue 19, item 5).

Before: the payload sizes of a snapshot's header are outside its checksum, and were used
as they came: `pickle_bytes` of -5 raised ValueError and 2^50 MemoryError out of
`load_newest`, so the replica stopped at start instead of falling back to an older
snapshot; and every writer killed mid-write (kill -9) left a `.writing-*` file that
nothing removed. Now a header that does not describe the payload the file holds is
corrupt (refused, the next older snapshot used), and partial files no live writer holds
are removed when the snapshot directory is opened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from coordinator_stub.durability.snapshot_format import SnapshotDir, SnapshotRefused, read

LANE = "unit"


def _save(folder, seq: int):
    return SnapshotDir(folder).save({"seq": seq, "payload": list(range(1000))},
                                    {"seq": seq, "chunk_size": 4})


def _with_header(path, **changes) -> None:
    magic, header, rest = path.read_bytes().split(b"\n", 2)
    meta = json.loads(header)
    meta.update(changes)
    path.write_bytes(magic + b"\n" + json.dumps(meta).encode() + b"\n" + rest)


@pytest.mark.parametrize("changes", [
    {"pickle_bytes": -5}, {"pickle_bytes": 2 ** 50}, {"pickle_bytes": "12"},
    {"pickle_bytes": 0}, {"pickle_bytes": True}, {"buffers": 7}, {"buffers": [-1]},
    {"buffers": [1]},  # sizes one byte more than the file holds
    {"blake3": 5},
], ids=lambda changes: ",".join(f"{k}={v!r}" for k, v in changes.items()))
def test_a_header_that_does_not_describe_the_payload_is_corrupt_and_an_older_one_used(
        tmp_path, changes):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    _with_header(newest, **changes)
    with pytest.raises(SnapshotRefused, match="corrupt"):
        read(newest, {})
    state, meta = SnapshotDir(tmp_path).load_newest({"chunk_size": 4})
    assert meta["seq"] == 1 and state["seq"] == 1


_BLOCKED_WRITER = textwrap.dedent("""
    import sys, time
    from coordinator_stub.durability.snapshot_format import SnapshotDir

    class Stuck:
        def __reduce__(self):  # pickled after the partial file is open: hold it there
            print("writing", flush=True)
            time.sleep(600)

    SnapshotDir(sys.argv[1]).save({"state": Stuck()}, {"seq": 9})
""")


@pytest.mark.coordinator
def test_partial_files_a_killed_writer_left_are_removed_at_start(tmp_path):
    _save(tmp_path, 1)
    writer = subprocess.Popen([sys.executable, "-c", _BLOCKED_WRITER, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        assert writer.stdout.readline() == "writing\n"
        partial = list(tmp_path.glob(".writing-*"))
        assert len(partial) == 1
        SnapshotDir(tmp_path)  # a peer starting while the write goes on: it is kept
        assert partial[0].exists()
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    (tmp_path / ".fetching-abc123").write_bytes(b"half a download")
    assert partial[0].exists()  # what kill -9 leaves
    snapshots = SnapshotDir(tmp_path)  # the replica starting again
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in snapshots.files()]
    assert snapshots.load_newest({})[1]["seq"] == 1
