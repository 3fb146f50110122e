"""Helpers for the coordinator's tests.

- Request bodies (`key`, `entry`, `batch`) and `refusal` (a 422 body in FastAPI's shape).
- `scrape(coord)`: `GET /metrics`, parsed: each sample's value by (name, sorted labels).
- `start_coordinator(clients, **overrides)`: an in-process coordinator on a free loopback
  port, driven over real HTTP through `Coordinator`. Chunk size 4 by default, so a chunk
  is four token ids. The `start` and `coord` fixtures (tests/conftest.py) build them,
  `CoordinatorConfig` overrides allowed.
"""

from __future__ import annotations

import io

import numpy as np

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from blend_wire import (
    BLEND_LOOKUP_PATH,
    DIRECTORY_KEYS_PATH,
    DIRECTORY_LOOKUP_PATH,
    EVENTS_PATH,
    INSTANCES_PATH,
    METRICS_PATH,
    STATS_PATH,
    encode,
    encode_tokens,
    pack_kv_rank,
)
from coordinator_stub import COORDINATOR, CoordinatorConfig, create_app

C = 4


#: Random chunk hashes and tokens for bodies whose text does not matter.
_RANDOM = np.random.default_rng(11)


def key(chunk_hash: str, model: str = "m", salt: str = "", world_size: int = 1,
        rank: int = 0, group: int = 0, kv_rank: int | None = None) -> dict:
    """A wire key; `kv_rank` given as is (even an invalid one) overrides world size and rank."""
    return {"chunk_hash_hex": chunk_hash, "model_name": model,
            "kv_rank": pack_kv_rank(world_size, rank) if kv_rank is None else kv_rank,
            "object_group_id": group, "cache_salt": salt}


def entry(chunk_hash: str, tokens=(), offset: int = -1, size: int = 64, **key_fields) -> dict:
    return {"key": key(chunk_hash, **key_fields), "size_bytes": size,
            "token_ids": list(tokens), "token_offset": offset}


def batch(*entries: dict, seq: int = 1, instance: str = "i0", incarnation: int = 0,
          event_type: str = "store", tier: str = "l1", backend: str = "dram",
          shared: bool = False) -> dict:
    return {"instance_id": instance, "incarnation": incarnation, "seq": seq,
            "event_type": event_type, "tier": tier, "backend": backend,
            "entries": list(entries), "shared": shared}


def store_batch(instance: str, seq: int, entries: int, chunk: int = 4,
                rng: np.random.Generator = _RANDOM) -> dict:
    """A STORE batch of `entries` chunks of `chunk` random tokens (random hashes) at
    consecutive offsets."""
    return batch(*[entry(rng.bytes(16).hex(), rng.integers(0, 2**31, chunk).tolist(),
                         offset=i * chunk) for i in range(entries)],
                 seq=seq, instance=instance)


def flood_body(batches: int, entries: int, instance: str = "flood", seq0: int = 1,
               chunk: int = 4) -> bytes:
    """An `/events` body of `batches` such STORE batches from one emitter."""
    return encode({"batches": [store_batch(instance, seq0 + i, entries, chunk)
                               for i in range(batches)]})


def refusal(body: dict) -> str:
    """A 422 body in FastAPI's shape, as one text (messages and locations) to search."""
    assert set(body) == {"detail"} and body["detail"], body
    for error in body["detail"]:
        assert set(error) == {"type", "loc", "msg", "input"}, error
        assert error["loc"][0] in ("body", "query"), error
    return " ".join(f"{e['msg']} {e['loc']}" for e in body["detail"])


async def scrape(coord) -> dict[tuple[str, tuple], float]:
    """`GET /metrics` (its Prometheus text media type checked): every sample's value by
    (name, sorted label pairs)."""
    response = await coord.call("GET", METRICS_PATH)
    assert response.headers["Content-Type"] == "text/plain; version=1.0.0; charset=utf-8"
    samples = {}
    for family in text_string_to_metric_families(await response.text()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


class Coordinator:
    """A running in-process coordinator and a client for it."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    @property
    def app(self):
        return self.client.server.app

    @property
    def coordinator(self):
        return self.app[COORDINATOR]

    @property
    def directory(self):
        return self.coordinator.directory

    async def call(self, method: str, path: str, expect: int = 200, **kwargs):
        data = kwargs.get("data")
        if isinstance(data, bytes) and len(data) > 1 << 20:
            kwargs["data"] = io.BytesIO(data)  # aiohttp warns of a large body given as bytes
        response = await self.client.request(method, path, **kwargs)
        assert response.status == expect, (path, response.status, await response.text())
        return response

    async def post_events(self, *batches: dict, expect: int = 200) -> dict:
        response = await self.call("POST", EVENTS_PATH, expect,
                                   data=encode({"batches": list(batches)}))
        return await response.json()

    async def lookup(self, tokens, model: str = "m", salt: str = "", world_size: int = 1
                     ) -> list[tuple[str, int, int]]:
        body = {"tokens_b64": encode_tokens(tokens), "model_name": model,
                "world_size": world_size, "cache_salt": salt}
        response = await self.call("POST", BLEND_LOOKUP_PATH, data=encode(body))
        return [(m["chunk_hash"], m["old_st"], m["cur_st"])
                for m in (await response.json())["matches"]]

    async def directory_lookup(self, expect: int = 200, **body) -> dict:
        response = await self.call("POST", DIRECTORY_LOOKUP_PATH, expect, data=encode(body))
        return await response.json()

    async def keys(self, expect: int = 200, **params) -> dict:
        response = await self.call("GET", DIRECTORY_KEYS_PATH, expect,
                                   params={k: str(v) for k, v in params.items()})
        return await response.json()

    async def stats(self) -> dict:
        return await (await self.call("GET", STATS_PATH)).json()

    async def register(self, instance_id: str = "", expect: int = 200, **fields) -> dict:
        body = {"instance_id": instance_id, "ip": "127.0.0.1", "http_port": 8080, **fields}
        return await (await self.call("POST", INSTANCES_PATH, expect, data=encode(body))).json()

    async def instances(self) -> list[dict]:
        return (await (await self.call("GET", INSTANCES_PATH)).json())["instances"]


async def start_coordinator(clients: list[TestClient], **overrides) -> Coordinator:
    config = CoordinatorConfig(**{"chunk_size": C, "enable_blend_lookup": True, "port": 0,
                                  "health_check_interval": 0.0, **overrides})
    client = TestClient(TestServer(create_app(config), host="127.0.0.1", port=0))
    await client.start_server()
    clients.append(client)
    return Coordinator(client)
