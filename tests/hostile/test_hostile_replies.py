"""The plugin trusts no coordinator reply (issue 19, item 4).

Before: a reply with `old_st` of 2^62 or 10^30 was handed to the engine as a segment (only
negative ones were dropped); a 200 MB padded reply or a 1 MB gzip bomb cost the serving
process ~250 MB and a 300-400 ms poll, with no cap on a reply's size. Now offsets outside
`[0, MAX_TOKEN_OFFSET]` and positions outside the query are dropped, and a reply is read
under `max_reply_bytes`, decoded (gzip included) no further than the cap.
"""

from __future__ import annotations

import gzip
import socket
import threading
import tracemalloc

import numpy as np

from helpers import HangingServer, LoopbackServer, Reply, take_when_done
from plugin import BlendCoordinatorClient, BlendNamespace, MatchState
from plugin.lookup import found_contents

LANE = "unit"

C = 16
NS = BlendNamespace("model", "", 1)
TOKENS = np.arange(4 * C, dtype=np.uint32)
CAP = 64 * 1024


class StreamingServer(HangingServer):
    """Answers every request with `head` then `pieces()`, sent as they are made (a body of
    any size without holding it)."""

    def __init__(self, head: bytes, pieces) -> None:
        self._head, self._pieces = head, pieces
        self.sent = 0
        super().__init__()

    def _handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(self._head)
            for piece in self._pieces():
                conn.sendall(piece)
                self.sent += len(piece)
        except OSError:
            pass  # the client hung up: what the cap is for


def client(url: str) -> BlendCoordinatorClient:
    return BlendCoordinatorClient(url, chunk_size=C, timeout=5.0, match_concurrency=1,
                                  max_reply_bytes=CAP)


def ask(url: str):
    made = client(url)
    try:
        assert made.submit("r", TOKENS, NS)
        return take_when_done(made, "r", timeout=10.0), made.stats()
    finally:
        made.close()


def ask_traced(url: str):
    """The hand-over, and the peak memory this process allocated while it was made."""
    tracemalloc.start()
    try:
        reply, _ = ask(url)
        return reply, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_offsets_outside_the_token_range_are_dropped_in_both_forms():
    default = (b'{"matches": [{"chunk_hash": "aa", "old_st": 4611686018427387904, "cur_st": 0},'
               b'{"chunk_hash": "bb", "old_st": 1000000000000000000000000000000, "cur_st": 16},'
               b'{"chunk_hash": "cc", "old_st": 32, "cur_st": 4611686018427387904},'
               b'{"chunk_hash": "dd", "old_st": 0, "cur_st": 32}]}')
    with LoopbackServer(lambda p, b: Reply(200, default)) as server:
        reply, stats = ask(server.url)
    assert reply.state is MatchState.DONE
    assert [(f.positions, f.chunks[0][0]) for f in found_contents(reply.found)] == [((32,), b"\xdd")]
    assert stats.dropped_entries == 3

    candidates = {"chunk_size": C, "candidates": [
        {"positions": [0], "chunks": [{"chunk_hash": "aa", "old_st": 2**62}]},
        {"positions": [2**62], "chunks": [{"chunk_hash": "bb", "old_st": 0}]},
        {"positions": [16, 8], "chunks": [{"chunk_hash": "cc", "old_st": 0}]},
        {"positions": [48], "chunks": [{"chunk_hash": "dd", "old_st": 2**53 - 1}]}]}
    with LoopbackServer(lambda p, b: Reply(200, candidates)) as server:
        reply, stats = ask(server.url)
    assert [(f.positions, f.chunks[0][0]) for f in found_contents(reply.found)] == [((48,), b"\xdd")]
    assert stats.dropped_entries == 3


def test_a_reply_of_another_chunk_size_is_refused():
    other = {"chunk_size": 2 * C, "candidates": [
        {"positions": [0], "chunks": [{"chunk_hash": "aa", "old_st": 0}]}]}
    with LoopbackServer(lambda p, b: Reply(200, other)) as server:
        reply, _ = ask(server.url)
    assert reply.state is MatchState.FAILED


def test_a_huge_padded_reply_is_cut_off_at_the_cap():
    # 200 MB of padding inside a valid JSON reply, with an honest content-length.
    size = 200 * 1024 * 1024

    def pieces():
        yield b'{"matches": ['
        block = b" " * (1 << 20)
        for _ in range(size // len(block)):
            yield block
        yield b"]}"

    head = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (size + 15))
    with StreamingServer(head, pieces) as server:
        reply, peak = ask_traced(server.url)
    assert reply.state is MatchState.FAILED
    assert peak < 16 * CAP + 8 * 1024 * 1024  # the cap and read buffers, not 200 MB
    assert server.sent < size // 2  # the client hung up long before the end


def test_a_gzip_bomb_is_inflated_no_further_than_the_cap():
    bomb = gzip.compress(b'{"matches": [' + b" " * (100 * 1024 * 1024) + b"]}", 9)
    assert len(bomb) < 200 * 1024  # ~100 KB on the wire
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
            b"content-length: %d\r\n\r\n" % len(bomb))
    with StreamingServer(head, lambda: iter([bomb])) as server:
        reply, peak = ask_traced(server.url)
    assert reply.state is MatchState.FAILED
    assert peak < 16 * CAP + 8 * 1024 * 1024


def test_a_compressed_honest_reply_still_works():
    body = gzip.compress(b'{"matches": [{"chunk_hash": "dd", "old_st": 0, "cur_st": 32}]}')
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
            b"content-length: %d\r\n\r\n" % len(body))
    with StreamingServer(head, lambda: iter([body])) as server:
        reply, _ = ask(server.url)
    assert reply.state is MatchState.DONE
    assert [f.positions for f in found_contents(reply.found)] == [(32,)]
