"""Helpers shared by the plugin tests (one place; test modules never import each other).

- Real loopback HTTP servers that misbehave on purpose: `LoopbackServer(behave)` serves
  HTTP/1.1 on 127.0.0.1 with a thread per connection; `behave(path, body) -> Reply` decides
  each answer (status, body, headers, delay before answering), and every request is recorded with the
  peak number answered concurrently. `HangingServer` accepts connections and never answers;
  `TricklingServer` answers one byte at a time, forever. `closed_port_url()` names a port
  nothing listens on.
- `wait_until(predicate)`: poll a condition with a timeout; returns its truthy value.
- `poll_lookup(plugin, key)`: call `cb_unified_lookup` as a scheduler does until it answers.
- `take_when_done(client, request_id)`: poll the client's hand-over until it is not pending.
- `store(plugin, host, key, hashes, start)`: what the engine does after saving a range: keep
  it in the host, then tell the plugin.
- `FakeClock`: a clock that moves only when the test says so (inject it instead of editing
  private deadlines). Tests assert no wall-clock bound; `NOT_HUNG_S` is the one deadline for
  "returned at all" where a bounded call takes a fraction of a second and an unbounded one
  hours (a trickling server).
- `python_lines(action, *packages)`: how many Python lines of `packages` run during
  `action()`, a deterministic measure of work for "cost does not grow with N" tests.
- `claim_one_by_one`: `ClaimLists.claim_new` done by `claim_all`, chunk by chunk, the
  reference the bulk claim is compared with.
- `remove_claim_holding(index, tokens, ...)`, `remove_chunk_holding(index, tokens, ...)`:
  LMCache's `BlendIndex` removals, which take the content the caller knows a claim by, on
  a `ContentIndex` (whose removals take none): the token check done here, then the removal.
- `build_tokenizer(folder, corpus)`: a small Hugging Face tokenizer (tokenizer.json and a
  chat template) written for the router's tests, `CHAT_TEMPLATE` its template.
- For the LMCache end-to-end tests (tests/e2e/test_lmcache_e2e.py,
  tests/e2e/lmcache057_negotiation_e2e.py): `tokens(n)`, random token ids from one seeded
  generator; `found(result)`, a lookup result's non-prefix segments as (old_st, cur_st);
  `HTTP_TIMEOUT` for their own requests to the coordinator.
"""

from __future__ import annotations

import json
import random
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, TypeVar

import numpy as np

from plugin import MatchState

T = TypeVar("T")


@dataclass
class Reply:
    status: int = 200
    body: bytes | str | dict = b'{"matches": []}'
    delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)

    def payload(self) -> bytes:
        if isinstance(self.body, dict):
            return json.dumps(self.body).encode()
        return self.body.encode() if isinstance(self.body, str) else self.body


def ok_reply(path: str, body: bytes) -> Reply:
    if path.endswith("/events"):
        batches = len(json.loads(body)["batches"])
        return Reply(200, {"applied": batches, "duplicates": 0, "stale": 0})
    return Reply(200, {"matches": []})


class LoopbackServer:
    """A real HTTP server on a free loopback port; `behave` may be swapped at any time."""

    def __init__(self, behave: Callable[[str, bytes], Reply] = ok_reply) -> None:
        self.behave = behave
        self.requests: list[tuple[str, bytes]] = []
        self.active = 0
        self.peak_active = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with server._lock:
                    server.requests.append((self.path, body))
                    server.active += 1
                    server.peak_active = max(server.peak_active, server.active)
                try:
                    reply = server.behave(self.path, body)
                    if reply.delay_s:
                        time.sleep(reply.delay_s)
                    payload = reply.payload()
                    self.send_response(reply.status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(payload)))
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with server._lock:
                        server.active -= 1

            do_GET = do_PUT = do_DELETE = do_POST

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.02,), daemon=True)
        self._thread.start()

    def bodies(self, path: str) -> list[dict]:
        with self._lock:
            return [json.loads(b) for p, b in self.requests if p == path]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "LoopbackServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HangingServer:
    """Accepts TCP connections and never sends a byte back."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        return len(self.accepted)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted.append(conn)
            self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        pass  # held open, never answered

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        for conn in self.accepted:
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TricklingServer(HangingServer):
    """Answers every connection one byte per `interval_s`, never finishing: the status line
    and headers (`part="headers"`), or a complete header then an endless body (`"body"`)."""

    def __init__(self, part: str = "headers", interval_s: float = 0.05) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        if part == "headers":
            self._prefix, self._trickle = b"", head + b"x-padding: " + b"a" * 10**6
        else:
            self._prefix = head + b"content-length: 1000000\r\n\r\n"
            self._trickle = b'{"matches": [' + b" " * 10**6
        self.interval_s = interval_s
        super().__init__()

    def _handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)  # the request (small enough for one read here)
            conn.sendall(self._prefix)
            for i in range(len(self._trickle)):
                if self._closed.wait(self.interval_s):
                    return
                conn.sendall(self._trickle[i:i + 1])
        except OSError:
            return  # the client gave up and closed the connection


def closed_port_url() -> str:
    """A loopback URL nothing listens on (the port was just released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def wait_until(predicate: Callable[[], T], timeout: float = 5.0, interval: float = 0.005) -> T:
    """Poll `predicate` until it returns something truthy, and return that (assert on it);
    past `timeout`, its last (falsy) value. Deadlines are generous: a loaded machine is slow."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def poll_lookup(plugin, key, tp_size: int = 1, timeout: float = 5.0, interval: float = 0.001):
    """Poll like a scheduler until the lookup completes: (result, seconds, calls)."""
    started, calls = time.monotonic(), 0
    while True:
        calls += 1
        result = plugin.cb_unified_lookup(key, tp_size)
        if result is not None:
            return result, time.monotonic() - started, calls
        assert time.monotonic() - started < timeout, f"lookup {key.request_id} did not complete"
        time.sleep(interval)


def take_when_done(client, request_id: str, timeout: float = 3.0):
    """The client's hand-over for `request_id` once it is no longer pending."""
    deadline = time.monotonic() + timeout
    while True:
        reply = client.take(request_id)
        if reply.state is not MatchState.PENDING:
            return reply
        assert time.monotonic() < deadline, f"query {request_id} still pending"
        time.sleep(0.005)


def store(plugin, host, key, hashes, start: int = 0) -> list[bytes]:
    """What the engine does after saving a range: keep it in the host, then tell the plugin."""
    host.store(key, hashes, start)
    plugin.on_store(key, hashes, start)
    return list(hashes)


NOT_HUNG_S = 30.0


class FakeClock:
    """A monotonic clock that moves only by `advance`."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def python_lines(action: Callable[[], object], *packages: str) -> int:
    """Python lines executed inside `packages` (default: the coordinator and the index)
    while `action()` runs: interpreted work, counted (numba kernels and C loops are not)."""
    folders = [f"/{p}/" for p in packages or ("coordinator_stub", "local_matcher")]
    count = 0

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        return local if any(folder in name for folder in folders) else None

    sys.settrace(tracer)
    try:
        action()
    finally:
        sys.settrace(None)
    return count


def slot_chunks(claims) -> list:
    """Every claim slot's chunk hash, None for a free slot."""
    free = set(claims._free_slots)
    named = claims.chunks.at(range(len(claims.slot_ns)))
    return [None if slot in free else chunk_hash for slot, chunk_hash in enumerate(named)]


def claim_one_by_one(claims, hashes, cids, offsets, namespaces, fresh):
    """`ClaimLists.claim_new` by `claim_all`, chunk by chunk (`fresh` unused: it knows)."""
    ids = np.empty(len(hashes), dtype=np.int32)
    claims.claim_all(hashes, cids.tolist(), offsets.tolist(), namespaces
                     if type(namespaces) is list else [namespaces] * len(hashes), ids)
    return ids


def apply_index_op(index, op: tuple) -> None:
    """One step of a content-index property test: ("add", tokens, hash, offset, namespace),
    ("add_many", rows, one_namespace_each), ("remove_claim", hash, namespace) or
    ("remove_chunk", hash); `rows` are (tokens, hash, offset, namespace)."""
    if op[0] == "add":
        index.add(op[1], op[2], op[3], op[4])
    elif op[0] == "add_many":
        contents, hashes, offsets, namespaces = zip(*op[1])
        index.add_many(np.array(contents, dtype=np.uint32), list(hashes), list(offsets),
                       list(namespaces) if op[2] else namespaces[0])
    elif op[0] == "remove_claim":
        index.remove_claim(op[1], op[2])
    else:
        index.remove_chunk(op[1])


def remove_claim_holding(index, tokens, chunk_hash, namespace) -> None:
    """LMCache's `remove_claim(tokens, chunk_hash, namespace)`: the namespace's claim goes
    only if its content is `tokens` (None: whatever it is)."""
    if tokens is None or _holds(index.tokens_of(chunk_hash, namespace), tokens):
        index.remove_claim(chunk_hash, namespace)


def remove_chunk_holding(index, tokens, chunk_hash, namespaces) -> None:
    """LMCache's `remove_chunk(tokens, chunk_hash)`: the chunk's claims (by any of
    `namespaces`) whose content is `tokens` go; None: the chunk with every claim."""
    if tokens is None:
        index.remove_chunk(chunk_hash)
        return
    for namespace in namespaces:
        remove_claim_holding(index, tokens, chunk_hash, namespace)


def _holds(content, tokens) -> bool:
    return content is not None and np.array_equal(content, np.asarray(tokens))


#: The chat template of `build_tokenizer`'s model: role markers around each message, as a
#: real model's template writes them (Llama 3's, ChatML's), the BOS from the config.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                 "<|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer(folder, corpus: str, chat_template: str | None = CHAT_TEMPLATE):
    """A small Hugging Face tokenizer written to `folder` (tokenizer.json, and a
    tokenizer_config.json carrying `chat_template` unless None): one id per word or
    punctuation mark of `corpus`, a BOS `<s>` added to text prompts, the chat markers as
    special tokens. Returns the `tokenizers.Tokenizer`."""
    from pathlib import Path
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["[UNK]", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    words = sorted(set(re.findall(r"\w+|[^\w\s]", corpus)))
    vocab = {token: i for i, token in enumerate(specials + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(specials)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer.save(str(folder / "tokenizer.json"))
    if chat_template is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
            "chat_template": chat_template}))
    return tokenizer


# --- the LMCache end-to-end tests ---------------------------------------------------------

HTTP_TIMEOUT = 30.0  # the tests' own requests to the coordinator: a slow answer is no failure
_rng = random.Random(20261129)


def tokens(n: int) -> list[int]:
    return [_rng.randrange(1000, 60000) for _ in range(n)]


def found(result) -> list[tuple[int, int]]:
    return [(s.old_st, s.cur_st) for s in result.non_prefix_segments]


def held_view(directory) -> dict:
    """The chunks each instance holds a placement of in a `KeyDirectory`: its `held_by` set
    (hot bindings) and its frozen bindings' chunks (the binding table's)."""
    bindings = directory._bindings
    instances = set(bindings.held_by) | set(bindings.table.frozen_of)
    return {i: frozenset(bindings.held_by.get(i, ())) | frozenset(
        bindings.table.frozen_chunks_of(i)) for i in instances}
