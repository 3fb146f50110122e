"""The price of each form of a blend-lookup reply, in one run: LMCache's default form, the
candidates as objects, the candidates as columns (docs/WIRE.md).

`price_forms` posts every query of a workload to a coordinator that holds it, in each form,
`rounds` times, the forms interleaved pass by pass (a drift of the machine touches all
alike), and measures per lookup:

- the coordinator process's CPU (psutil: its whole handling, HTTP included, black box);
- this process's CPU to read the reply as the plugin does and select from it (the plugin's
  `plugin.replies.found_in`, then `plugin.lookup.select` of the fleet leg with an empty
  local leg and no prefix; the default form is read the same way);
- the reply's bytes, per chunk the reply names (chunks offered) and per query position
  where a found content occurs (query chunks found), and the same at 32-byte chunk hashes
  (LMCache's blake3; the benchmarks' `InMemoryHost` names chunks with 16 bytes): exact, as
  both candidates forms spend a fixed number of characters per hash byte.

Used by `benchmarks.bench_rag.run_one` (so `make bench-rag` and `make bench-granularity`
print it).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import httpx
import numpy as np
import psutil

from blend_wire import BLEND_LOOKUP_PATH, BlendCandidatesReply, decode, uints_in
from plugin.lookup import select
from plugin.replies import found_in
from plugin.types import NOTHING_FOUND

#: The forms, each with the fields its request adds to LMCache's body.
FORMS = {"default": {}, "objects": {"candidates": True},
         "columns": {"candidates": True, "columns": True}}
#: The hash width LMCache names chunks with (blake3).
LMCACHE_HASH_BYTES = 32


@dataclass
class FormPrice:
    lookups: int = 0
    replies: int = 0            # the replies of one pass, whose bytes are counted
    reply_bytes: int = 0
    reply_bytes_at_32: int = 0  # the same replies, had every chunk hash 32 bytes
    chunks_named: int = 0       # chunks the replies offer (the default form: its matches)
    positions_found: int = 0    # query positions where a found content occurs
    coordinator_cpu_s: float = 0.0
    plugin_cpu_s: float = 0.0

    def plus(self, other: "FormPrice") -> "FormPrice":
        """Both passes' figures together."""
        return FormPrice(*(a + b for a, b in zip(dataclasses.astuple(self),
                                                 dataclasses.astuple(other))))

    def per_lookup_ms(self, seconds: float) -> float:
        return seconds / max(self.lookups, 1) * 1e3

    @property
    def coordinator_ms(self) -> float:
        return self.per_lookup_ms(self.coordinator_cpu_s)

    @property
    def plugin_ms(self) -> float:
        return self.per_lookup_ms(self.plugin_cpu_s)

    def bytes_per(self, count: int, at_32: bool = False) -> float:
        return (self.reply_bytes_at_32 if at_32 else self.reply_bytes) / max(count, 1)


def _named(content: bytes) -> tuple[int, int, int]:
    """(chunks named, positions found, hash width) of a reply of any form."""
    reply = decode(content, BlendCandidatesReply)
    if reply.columns is not None:
        columns = reply.columns
        return (len(columns.chunk_hashes) // 4 * 3 // columns.hash_bytes,
                uints_in(columns.positions), columns.hash_bytes)
    if reply.candidates is not None:
        chunks = [c for content in reply.candidates for c in content.chunks]
        width = len(chunks[0].chunk_hash) // 2 if chunks else LMCACHE_HASH_BYTES
        return len(chunks), sum(len(c.positions) for c in reply.candidates), width
    width = len(reply.matches[0].chunk_hash) // 2 if reply.matches else LMCACHE_HASH_BYTES
    return len(reply.matches), len(reply.matches), width


def _at_32(form: str, size: int, chunks: int, width: int) -> int:
    """A reply's size had its `chunks` hashes been 32 bytes instead of `width`."""
    if form != "columns":  # hex: two characters per byte
        return size + chunks * (LMCACHE_HASH_BYTES - width) * 2
    base64 = lambda raw: (raw + 2) // 3 * 4  # noqa: E731
    return size + base64(chunks * LMCACHE_HASH_BYTES) - base64(chunks * width)


def price_forms(http: httpx.Client, coordinator_pid: int, queries: list[np.ndarray],
                bodies: list[dict], chunk: int, instance_ids: list[str], rounds: int
                ) -> dict[str, FormPrice]:
    """Each form's `FormPrice` over `rounds` passes of `queries` (module doc); `bodies`:
    each query's blend-lookup body in LMCache's default form; `instance_ids`: the server
    asking each (where its own L1 is)."""
    process = psutil.Process(coordinator_pid)
    prices = {form: FormPrice() for form in FORMS}
    for form, extra in FORMS.items():  # warm-up: connections, numba, first replies
        warm = http.post(BLEND_LOOKUP_PATH, json={**bodies[0], **extra})
        warm.raise_for_status()
        found = found_in(warm.content, "bench", chunk_size=chunk, instance_id=instance_ids[0],
                         num_tokens=len(queries[0]))
        select(NOTHING_FOUND, found.contents, 0, chunk)
    for round_ in range(rounds):
        for form, extra in FORMS.items():
            price = prices[form]
            replies = []
            cpu = sum(process.cpu_times()[:2])
            for body in bodies:
                reply = http.post(BLEND_LOOKUP_PATH, json={**body, **extra})
                reply.raise_for_status()
                replies.append(reply.content)
            price.coordinator_cpu_s += sum(process.cpu_times()[:2]) - cpu
            started = time.process_time()
            for tokens, content, instance_id in zip(queries, replies, instance_ids):
                found = found_in(content, "bench", chunk_size=chunk, instance_id=instance_id,
                                 num_tokens=len(tokens))
                select(NOTHING_FOUND, found.contents, 0, chunk)
            price.plugin_cpu_s += time.process_time() - started
            price.lookups += len(replies)
            if round_ == 0:
                price.replies = len(replies)
                for content in replies:
                    chunks, positions, width = _named(content)
                    price.reply_bytes += len(content)
                    price.reply_bytes_at_32 += _at_32(form, len(content), chunks, width)
                    price.chunks_named += chunks
                    price.positions_found += positions
    return prices


def forms_table(rows: list[tuple[str, int, dict[str, FormPrice]]]) -> list[str]:
    """One Markdown row per (workload, chunk size, form)."""
    head = ["workload", "chunk", "form", "reply bytes / lookup", "B / chunk offered",
            "B / query chunk found", "same at 32-byte hashes: B / chunk offered",
            "B / query chunk found", "coordinator CPU ms / lookup",
            "plugin read + select CPU ms / lookup"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for workload, chunk, prices in rows:
        for form, p in prices.items():
            lines.append("| " + " | ".join([
                workload, str(chunk), form, f"{p.reply_bytes / max(p.replies, 1):,.0f}",
                f"{p.bytes_per(p.chunks_named):.1f}", f"{p.bytes_per(p.positions_found):.1f}",
                f"{p.bytes_per(p.chunks_named, True):.1f}",
                f"{p.bytes_per(p.positions_found, True):.1f}",
                f"{p.coordinator_ms:.3f}", f"{p.plugin_ms:.3f}"]) + " |")
    return lines
