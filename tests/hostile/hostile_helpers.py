"""Helpers of the hostile-client tests (issue 11): event batches built field by field, so a
test can break one, and a client for an in-process coordinator with chunk size 4."""

from __future__ import annotations

from aiohttp.test_utils import TestClient

from blend_wire import (BLEND_LOOKUP_PATH, EVENTS_PATH, STATS_PATH, encode, encode_tokens,
                        pack_kv_rank)
from coordinator_stub import COORDINATOR

C = 4
A = [11, 12, 13, 14]
B = [21, 22, 23, 24]


def key(chunk_hash: str = "aa01", model: str = "m", salt: str = "", kv_rank: int | None = None,
        group: int = 0) -> dict:
    return {"chunk_hash_hex": chunk_hash, "model_name": model,
            "kv_rank": pack_kv_rank(1) if kv_rank is None else kv_rank,
            "object_group_id": group, "cache_salt": salt}


def entry(chunk_hash: str = "aa01", tokens=A, offset: int = 0, size_bytes: int = 64,
          **key_fields) -> dict:
    return {"key": key(chunk_hash, **key_fields), "size_bytes": size_bytes,
            "token_ids": list(tokens), "token_offset": offset}


def batch(*entries: dict, seq: int = 1, instance: str = "i0", incarnation: int = 0,
          event_type: str = "store", tier: str = "l1", backend: str = "dram") -> dict:
    return {"instance_id": instance, "incarnation": incarnation, "seq": seq,
            "event_type": event_type, "tier": tier, "backend": backend,
            "entries": list(entries)}


class Coord:
    """An in-process coordinator and a client for it."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    @property
    def coordinator(self):
        return self.client.server.app[COORDINATOR]

    async def post_events(self, *batches: dict, expect: int = 200) -> dict:
        response = await self.client.post(EVENTS_PATH, data=encode({"batches": list(batches)}))
        assert response.status == expect, await response.text()
        return await response.json()

    async def lookup(self, tokens, model: str = "m", salt: str = "") -> list[tuple[str, int, int]]:
        body = {"tokens_b64": encode_tokens(tokens), "model_name": model, "cache_salt": salt}
        response = await self.client.post(BLEND_LOOKUP_PATH, data=encode(body))
        assert response.status == 200, await response.text()
        return [(m["chunk_hash"], m["old_st"], m["cur_st"])
                for m in (await response.json())["matches"]]

    async def stats(self) -> dict:
        response = await self.client.get(STATS_PATH)
        assert response.status == 200, await response.text()
        return await response.json()


