"""The coordinator's request logic, free of HTTP: body in, reply body out.

Contract:
- `submit_events(body)`: queue an `/events` body with the fair ingest scheduler
  (`coordinator_stub.ingest`); the future resolves to the reply body. Every batch is
  validated before the first is applied: a body that fails raises `WireError` (-> 422)
  and nothing of it is applied. Then the directory gates and applies the batches in
  order, one at a time, taking turns with other emitters. `ingest_budget` bounds the
  request bytes in flight (the HTTP layer reserves before reading a body).
- `lookup(body)`: validate, refuse queries over `max_query_tokens` with `TooLarge`
  (-> 413) before decoding them, and match in the caller's namespace. With blend lookup
  off, or a query shorter than one chunk, the answer is `{"matches": []}`.
- `stats()`: the directory's stats object, JSON-encoded.

`lookup` is `answer(parse_lookup(body))`, split so the HTTP layer can validate a small
body's shape on the event loop and hand the token decoding (a GIL-free kernel) and the
matching to a worker thread. Everything else
blocks (locks, CPU-bound work) and runs on worker threads, never on the loop. All reply
bodies are encoded with `blend_wire.encode`, the one owner of the wire shapes.
"""

from __future__ import annotations

import concurrent.futures

from coordinator_stub.config import CoordinatorConfig
from coordinator_stub.directory import KeyDirectory
from coordinator_stub.ingest import ByteBudget, FairIngest
from blend_wire import (
    BlendLookupReply,
    BlendLookupRequest,
    CacheEventBatch,
    WireBlendMatch,
    decode,
    decode_tokens,
    encode,
)


class TooLarge(Exception):
    """A request beyond a configured limit (-> 413). The message says which limit."""


_EMPTY_LOOKUP = encode(BlendLookupReply(matches=[]))


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.directory = KeyDirectory(chunk_size=config.chunk_size,
                                      probe_stride=config.blend_probe_stride,
                                      enable_blend_lookup=config.enable_blend_lookup)
        self.ingest_queue = FairIngest(self._apply_batch)
        self.ingest_budget = ByteBudget(config.max_ingest_bytes)
        decode_tokens("AAAAAA==")  # compile (or load) the codec kernel before any request

    def submit_events(self, body: bytes) -> concurrent.futures.Future:
        """Queue an `/events` body; the future's result is the reply body (`bytes`)."""
        reply: concurrent.futures.Future = concurrent.futures.Future()

        def done(job: concurrent.futures.Future) -> None:
            error = job.exception()
            if error is not None:
                reply.set_exception(error)
            else:
                reply.set_result(encode(job.result()))
        self.ingest_queue.submit(body).add_done_callback(done)
        return reply

    def _apply_batch(self, batch: CacheEventBatch) -> str:
        reply = self.directory.ingest([batch])
        return "applied" if reply.applied else "duplicate" if reply.duplicates else "stale"

    def lookup(self, body: bytes) -> bytes:
        return self.answer(self.parse_lookup(body))

    def parse_lookup(self, body: bytes) -> BlendLookupRequest:
        """Validate a blend-lookup body's shape, and its size from the text alone."""
        request = decode(body, BlendLookupRequest)
        # Base64 carries 3 bytes per 4 characters (padding aside): refuse an oversized
        # query from its text length, before spending time and memory decoding it.
        cap = self.config.max_query_tokens
        if (len(request.tokens_b64) // 4 * 3 - 2) // 4 > cap:
            raise TooLarge(f"query exceeds {cap} tokens (--max-query-tokens)")
        return request

    def answer(self, request: BlendLookupRequest) -> bytes:
        """Decode the query's tokens (WireError if they are not valid) and match them."""
        tokens = decode_tokens(request.tokens_b64)
        if tokens.size > self.config.max_query_tokens:
            raise TooLarge(f"query of {tokens.size} tokens exceeds "
                           f"{self.config.max_query_tokens} (--max-query-tokens)")
        if not self.directory.blend_enabled or tokens.size < self.config.chunk_size:
            return _EMPTY_LOOKUP
        matches = self.directory.match(tokens, request.namespace)
        return encode(BlendLookupReply(matches=[
            WireBlendMatch(chunk_hash=m.chunk_hash.hex(), old_st=m.old_st, cur_st=m.cur_st)
            for m in matches]))

    def stats(self) -> bytes:
        return encode(self.directory.stats())


__all__ = ["Coordinator", "TooLarge"]
