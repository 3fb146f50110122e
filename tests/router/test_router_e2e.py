"""The router end to end (issue 23): `python -m blend_router` and the coordinator as real
processes, stand-in serving instances as real HTTP servers on loopback.

What users rely on: a request goes to the instance whose L1 holds its content (token ids,
text through the tokenizer, chat messages), the answer streams back as the instance sends
it; with nothing cached, or the coordinator slow or down, requests still go out,
least-loaded / round-robin; an unreachable instance is skipped; bad input is refused with a
reason and forwarded nowhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import jinja2
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from blend_wire import ENGINE_URL_KEY, EVENTS_PATH, INSTANCES_PATH, encode, pack_kv_rank
from coordinator_stub.launch.process import launch_coordinator
from helpers import (
    CHAT_TEMPLATE,
    LoopbackServer,
    Reply,
    build_tokenizer,
    closed_port_url,
    wait_until,
)

LANE = "coordinator"

C = 16
MODEL = "m"
rng = np.random.default_rng(230)
#: Turns of a chat, each shorter than a chunk: every stored chunk of the rendered chat holds
#: the template's markers, so only ids rendered with the model's template match them.
TURNS = [{"role": "system", "content": "You answer in five words."},
         {"role": "user", "content": "Which river crosses the basin?"},
         {"role": "assistant", "content": "The Amazon river does."},
         {"role": "user", "content": "And which nations hold it?"},
         {"role": "assistant", "content": "Brazil, Peru and Colombia."},
         {"role": "user", "content": "How much is in Brazil?"},
         {"role": "assistant", "content": "Sixty percent of it."}]
PASSAGE_TEXT = (
    "The Amazon rainforest covers much of the Amazon basin of South America. This basin "
    "encompasses seven million square kilometres, of which five and a half million are "
    "covered by the rainforest. The region includes territory belonging to nine nations and "
    "3,344 formally acknowledged indigenous territories. The majority of the forest is "
    "contained within Brazil, with sixty percent of the rainforest, followed by Peru and "
    "Colombia.\n\n")


CORPUS = PASSAGE_TEXT + " ".join(t["content"] for t in TURNS) + \
    " Answer from the passage below. Who else? Say more."


def model_ids(folder, text: str, add_special_tokens: bool = False) -> list[int]:
    """`text`'s ids with the model's tokenizer.json in `folder`, as its engine stores them."""
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(
        text, add_special_tokens=add_special_tokens).ids


def chat_ids(folder, messages: list[dict]) -> list[int]:
    """The chat as the engine renders it with the model's template, then its ids."""
    return model_ids(folder, jinja2.Template(CHAT_TEMPLATE).render(
        messages=messages, bos_token="<s>", add_generation_prompt=True))


def fresh(n: int) -> list[int]:
    return rng.integers(1000, 60000, n).tolist()


class Backend:
    """A stand-in serving instance: answers completions, streamed (SSE) or not, with its
    name, and records every body it got; `hold`, when set, keeps each answer back until it
    is set (work queued there). Its `POST /tokenize` answers as vLLM's does, with `tokenizer`
    (a `tokenizers.Tokenizer`) and `CHAT_TEMPLATE`, after `tokenize_delay_s`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bodies: list[dict] = []
        self.tokenize_bodies: list[dict] = []
        self.hold: asyncio.Event | None = None
        self.tokenizer = None
        self.tokenize_delay_s = 0.0
        app = web.Application()
        app.router.add_post("/v1/completions", self.answer)
        app.router.add_post("/v1/chat/completions", self.answer)
        app.router.add_post("/tokenize", self.tokenize)
        self.server = TestServer(app, host="127.0.0.1", port=0)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenize_bodies.append(body)
        await asyncio.sleep(self.tokenize_delay_s)
        if "messages" in body:
            text = jinja2.Template(CHAT_TEMPLATE).render(
                messages=body["messages"], bos_token="<s>",
                add_generation_prompt=body.get("add_generation_prompt", True))
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        else:
            ids = self.tokenizer.encode(body["prompt"],
                                        add_special_tokens=body.get("add_special_tokens",
                                                                    True)).ids
        return web.json_response({"count": len(ids), "max_model_len": 8192, "tokens": ids})

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.hold is not None:
            await self.hold.wait()
        if not body.get("stream"):
            return web.json_response({"served_by": self.name})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(3):
            await response.write(f"data: {json.dumps({'by': self.name, 'i': i})}\n\n".encode())
            await asyncio.sleep(0.01)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def sse_of(name: str) -> str:
    return "".join(f"data: {json.dumps({'by': name, 'i': i})}\n\n" for i in range(3)) + \
        "data: [DONE]\n\n"


@contextlib.asynccontextmanager
async def backends(*names: str):
    made = [Backend(name) for name in names]
    for backend in made:
        await backend.server.start_server()
    try:
        yield {b.name: b for b in made}
    finally:
        for backend in made:
            await backend.server.close()


def register(coordinator_url: str, instance_id: str, port: int) -> None:
    """`instance_id` registers as a serving process does, naming its engine on `port`
    (LMCache's own front end, `ip:http_port`, is a port the router never dials)."""
    httpx.post(coordinator_url + INSTANCES_PATH, json={
        "instance_id": instance_id, "ip": "127.0.0.1", "http_port": closed_port(),
        "metadata": {ENGINE_URL_KEY: f"http://127.0.0.1:{port}"}}).raise_for_status()


def closed_port() -> int:
    return int(closed_port_url().rsplit(":", 1)[1])


def store(coordinator_url: str, instance_id: str, tokens, seq: int) -> None:
    """`instance_id` reports the whole chunks of `tokens` as stored in its L1."""
    tokens = list(tokens)
    entries = [{"key": {"chunk_hash_hex": f"{seq:04x}{instance_id.encode().hex()}{k:04x}",
                        "model_name": MODEL, "kv_rank": pack_kv_rank(1)},
                "size_bytes": 1, "token_ids": tokens[k * C:(k + 1) * C], "token_offset": k * C}
               for k in range(len(tokens) // C)]
    reply = httpx.post(coordinator_url + EVENTS_PATH, content=encode({"batches": [{
        "instance_id": instance_id, "seq": seq, "event_type": "store", "tier": "l1",
        "backend": "dram", "entries": entries}]}))
    reply.raise_for_status()
    assert reply.json()["applied"] == 1


@contextlib.contextmanager
def router(coordinator_url: str, *flags: str):
    with launch_coordinator("--coordinator-url", coordinator_url, "--refresh-interval", "0.2",
                            *flags, module="blend_router") as process:
        yield process.url


async def knows(url: str, count: int) -> None:
    def ready():
        return httpx.get(url + "/healthz").json()["instances"] == count
    assert await asyncio.to_thread(wait_until, ready, 20.0, 0.05)


async def post(url: str, path: str, body, stream: bool = False) -> tuple[int, dict, str]:
    def call():
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        with httpx.Client(timeout=30.0) as client:
            with client.stream("POST", url + path, content=content,
                               headers={"Content-Type": "application/json"}) as response:
                text = "".join(response.iter_text())
                return response.status_code, response.headers, text
    return await asyncio.to_thread(call)


@pytest.fixture
def coordinator():
    with launch_coordinator("--enable-blend-lookup", "--chunk-size", str(C),
                            "--health-check-interval", "0") as process:
        yield process


async def test_requests_go_where_their_content_is_and_answers_stream_back(coordinator,
                                                                          tmp_path):
    build_tokenizer(tmp_path, CORPUS)
    text_ids = model_ids(tmp_path, PASSAGE_TEXT)
    passage_ids = fresh(3 * C)
    assert len(text_ids) >= 3 * C
    async with backends("A", "B", "C") as fleet:
        for name, backend in fleet.items():
            register(coordinator.url, name, backend.server.port)
        store(coordinator.url, "B", passage_ids, seq=1)
        store(coordinator.url, "C", text_ids, seq=1)
        with router(coordinator.url, "--score-budget", "5", "--tokenizer", str(tmp_path)) as url:
            await knows(url, 3)
            prompt = fresh(5) + passage_ids + fresh(7)
            status, headers, text = await post(url, "/v1/completions", {
                "model": MODEL, "prompt": prompt, "stream": True, "max_tokens": 4})
            assert (status, headers["x-routed-to"], headers["x-route-reason"]) == \
                (200, "B", "score")
            assert headers["content-type"].startswith("text/event-stream")
            assert text == sse_of("B")
            assert fleet["B"].bodies[-1]["prompt"] == prompt  # forwarded as received

            status, headers, text = await post(url, "/v1/chat/completions", {
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "prompt_token_ids": fresh(3) + passage_ids})
            assert (status, headers["x-routed-to"], json.loads(text)) == \
                (200, "B", {"served_by": "B"})

            # Text, through the model's tokenizer: the passage C holds, behind an instruction.
            status, headers, _ = await post(url, "/v1/completions", {
                "model": MODEL, "prompt": "Answer from the passage below.\n\n" + PASSAGE_TEXT})
            assert (status, headers["x-routed-to"], headers["x-route-reason"]) == \
                (200, "C", "score")
            status, headers, _ = await post(url, "/v1/chat/completions", {
                "model": MODEL, "messages": [
                    {"role": "system", "content": "You answer in five words."},
                    {"role": "user", "content": [{"type": "text", "text": PASSAGE_TEXT}]}]})
            assert (status, headers["x-routed-to"]) == (200, "C")

            # Another namespace holds nothing: least-loaded, round-robin among the idle.
            served = set()
            for _ in range(3):
                status, headers, _ = await post(url, "/v1/completions", {
                    "model": "other-model", "prompt": prompt})
                assert (status, headers["x-route-reason"]) == (200, "nothing-cached")
                served.add(headers["x-routed-to"])
            assert served == {"A", "B", "C"}


async def test_an_unreachable_instance_is_skipped_and_bad_input_refused(coordinator):
    passage_ids = fresh(2 * C)
    async with backends("A") as fleet:
        register(coordinator.url, "A", fleet["A"].server.port)
        register(coordinator.url, "gone", closed_port())
        store(coordinator.url, "gone", passage_ids, seq=1)
        with router(coordinator.url, "--score-budget", "5") as url:
            await knows(url, 2)
            status, headers, text = await post(url, "/v1/completions", {
                "model": MODEL, "prompt": passage_ids})
            assert (status, headers["x-routed-to"], headers["x-route-reason"]) == \
                (200, "A", "retry-after-unreachable")
            before = len(fleet["A"].bodies)
            for bad in (b"[1, 2]", b"{not json",
                        {"model": MODEL, "prompt": [1, -3]},
                        {"model": MODEL, "prompt": [1, 2**32]},
                        {"model": MODEL, "messages": [], "prompt_token_ids": "12"}):
                status, _, text = await post(url, "/v1/completions"
                                             if "messages" not in str(bad)
                                             else "/v1/chat/completions", bad)
                assert status == 422 and json.loads(text)["detail"], (bad, text)
            assert len(fleet["A"].bodies) == before


async def test_with_the_coordinator_down_requests_still_go_out_round_robin(coordinator):
    async with backends("A", "B") as fleet:
        for name, backend in fleet.items():
            register(coordinator.url, name, backend.server.port)
        with router(coordinator.url, "--score-budget", "5") as url:
            await knows(url, 2)
            coordinator.stop()
            served = []
            for _ in range(4):
                status, headers, text = await post(url, "/v1/completions", {
                    "model": MODEL, "prompt": fresh(40), "stream": True})
                assert (status, headers["x-route-reason"]) == (200, "coordinator-unavailable")
                assert text == sse_of(headers["x-routed-to"])
                served.append(headers["x-routed-to"])
            assert sorted(served) == ["A", "A", "B", "B"]


async def test_a_slow_coordinator_costs_the_budget_not_the_request():
    async with backends("A", "B") as fleet:
        listing = {"instances": [
            {"instance_id": name, "ip": "127.0.0.1", "http_port": b.server.port,
             "registration_time": 0.0, "metadata": {ENGINE_URL_KEY: f"http://127.0.0.1:{b.server.port}"},
             "p2p_advertised_url": "", "mq_port": 0}
            for name, b in fleet.items()]}

        def behave(path: str, body: bytes) -> Reply:
            if path == INSTANCES_PATH:
                return Reply(200, listing)
            return Reply(200, {"chunk_size": C, "instances": []}, delay_s=3.0)

        with LoopbackServer(behave) as slow, router(slow.url, "--score-budget", "0.2") as url:
            await knows(url, 2)
            status, headers, text = await post(url, "/v1/completions", {
                "model": MODEL, "prompt": fresh(40)})
            assert (status, headers["x-route-reason"]) == (200, "coordinator-unavailable")
            assert json.loads(text) == {"served_by": headers["x-routed-to"]}
            assert any(p.endswith("/blend-score") for p, _ in slow.requests)


async def test_no_instance_known_is_503(coordinator):
    with router(coordinator.url) as url:
        status, _, text = await post(url, "/v1/completions", {"model": MODEL, "prompt": [1]})
        assert status == 503 and "no serving instance" in json.loads(text)["detail"]


async def test_a_chat_is_scored_as_the_model_renders_it(coordinator, tmp_path):
    build_tokenizer(tmp_path / "model", CORPUS)
    build_tokenizer(tmp_path / "no-template", CORPUS, chat_template=None)
    follow_up = TURNS + [{"role": "user", "content": "Who else?"}]
    async with backends("A", "B") as fleet:
        for name, backend in fleet.items():
            register(coordinator.url, name, backend.server.port)
        store(coordinator.url, "B", chat_ids(tmp_path / "model", TURNS), seq=1)
        with router(coordinator.url, "--score-budget", "5",
                    "--tokenizer", str(tmp_path / "model")) as url:
            await knows(url, 2)
            status, headers, _ = await post(url, "/v1/chat/completions", {
                "model": MODEL, "messages": follow_up})
            assert (status, headers["x-routed-to"], headers["x-route-reason"]) == \
                (200, "B", "score")
        # Without the template, each message on its own: no stored chunk (all hold
        # markers) matches, which is what the template is for.
        with router(coordinator.url, "--score-budget", "5",
                    "--tokenizer", str(tmp_path / "no-template" / "tokenizer.json")) as url:
            await knows(url, 2)
            status, headers, _ = await post(url, "/v1/chat/completions", {
                "model": MODEL, "messages": follow_up})
            assert (status, headers["x-route-reason"]) == (200, "nothing-cached")


async def test_text_and_chats_tokenized_by_the_engine_within_the_budget(coordinator, tmp_path):
    tokenizer = build_tokenizer(tmp_path, CORPUS)
    async with backends("A", "B", "C") as fleet:
        for name, backend in fleet.items():
            backend.tokenizer = tokenizer
            register(coordinator.url, name, backend.server.port)
        store(coordinator.url, "B", chat_ids(tmp_path, TURNS), seq=1)
        store(coordinator.url, "C", model_ids(tmp_path, PASSAGE_TEXT), seq=1)
        with router(coordinator.url, "--score-budget", "5", "--engine-tokenize") as url:
            await knows(url, 3)
            prompt = "Answer from the passage below.\n\n" + PASSAGE_TEXT
            status, headers, _ = await post(url, "/v1/completions", {
                "model": MODEL, "prompt": prompt})
            assert (status, headers["x-routed-to"], headers["x-route-reason"]) == \
                (200, "C", "score")
            asked = [b for backend in fleet.values() for b in backend.tokenize_bodies]
            assert asked == [{"model": MODEL, "prompt": prompt, "add_special_tokens": True}]
            status, headers, _ = await post(url, "/v1/chat/completions", {
                "model": MODEL, "messages": TURNS + [{"role": "user", "content": "Who else?"}]})
            assert (status, headers["x-routed-to"], headers["x-route-reason"]) == \
                (200, "B", "score")
        for backend in fleet.values():
            backend.tokenize_delay_s = 3.0
        with router(coordinator.url, "--score-budget", "0.3", "--engine-tokenize") as url:
            await knows(url, 3)
            status, headers, text = await post(url, "/v1/completions", {
                "model": MODEL, "prompt": prompt})
            assert (status, headers["x-route-reason"]) == (200, "unscored")
            assert json.loads(text) == {"served_by": headers["x-routed-to"]}


async def test_an_instance_with_work_queued_is_passed_over(coordinator):
    passage_ids = fresh(3 * C)
    prompt = fresh(5) + passage_ids + fresh(7)
    async with backends("A", "B") as fleet:
        for name, backend in fleet.items():
            register(coordinator.url, name, backend.server.port)
        store(coordinator.url, "A", passage_ids, seq=1)
        fleet["A"].hold = asyncio.Event()
        with router(coordinator.url, "--score-budget", "5") as url:
            await knows(url, 2)
            first = asyncio.create_task(post(url, "/v1/completions", {
                "model": MODEL, "prompt": prompt}))
            assert await asyncio.to_thread(wait_until, lambda: fleet["A"].bodies, 20.0, 0.02)
            # A holds the content but has a request in flight: B, for the load.
            status, headers, _ = await post(url, "/v1/completions", {
                "model": MODEL, "prompt": prompt})
            assert (status, headers["x-routed-to"], headers["x-route-reason"]) == \
                (200, "B", "load")
            fleet["A"].hold.set()
            status, headers, _ = await first
            assert (status, headers["x-routed-to"], headers["x-route-reason"]) == \
                (200, "A", "score")
            # A's work is over: the content wins again.
            status, headers, _ = await post(url, "/v1/completions", {
                "model": MODEL, "prompt": prompt})
            assert (status, headers["x-routed-to"], headers["x-route-reason"]) == \
                (200, "A", "score")
