"""`make bench-bounded`: one request's work is bounded (issue 30, item 3; docs/WIRE.md, "Limits").

Two parts, each against a real coordinator process (`python -m coordinator_stub`) over HTTP on
127.0.0.1; CPU is the coordinator process's (user + system, from /proc), so it counts
everything a request costs there (HTTP, decoding, matching, the reply):

1. **Repeated tokens** (`--chunk-size` 8): `--instances` 16 instances each hold one chunk
   of one token repeated (16 chunk hashes, one content), then a gzipped query of
   `--tokens` 2^20 of that token is sent in each form (blend score, candidates lookup,
   default lookup), and 0.2 s after each a small lookup (4096 other tokens) from another
   client. Per form: the status, the coordinator's CPU and wall time for the big request,
   its reply's bytes and `truncated`, and how long the small lookup waited. Targets: the
   score <= 0.5 s of CPU, the candidates reply <= 4 MiB, the small lookup <= 1 s.
2. **Score against lookup** (`--score-chunk-size` 64): `--score-instances` 64 instances;
   MuSiQue question i's whole prompt (system, its passages, the question) stored on
   instance i mod 64 under LMCache's chained names, then each question asked again with its
   passages in another order, as a blend score of every instance and as a candidates
   lookup (the same bodies), `--rounds` times, forms alternating. Per request: the
   coordinator's CPU in each form and their ratio (target: score <= 2x the lookup); and
   the same without HTTP, this checkout's `Coordinator` in this process fed the same
   events (`time.process_time`), where the HTTP layer's share does not dilute the ratio.

`--coordinator-root DIR` runs the coordinator of another checkout (e.g. main, for the figures
before a change) with this client. Prints the machine and the load (`/proc/loadavg`).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import os
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import msgspec
import numpy as np

from benchmarks.bench_rag import load_musique, prompt
from benchmarks.common import machine_description
from benchmarks.musique_data import MUSIQUE_DATA_DIR
from blend_wire import (BLEND_LOOKUP_PATH, BLEND_SCORE_PATH, EVENTS_PATH, INSTANCES_PATH,
                        encode, encode_tokens, pack_kv_rank, prefix_chunk_hashes)
from coordinator_stub.launch.process import CoordinatorProcess, start_coordinator

REPEATED_TOKEN = 7
SMALL_LOOKUP_TOKENS = 4096
SMALL_LOOKUP_DELAY_S = 0.2
FORMS = {"blend-score": (BLEND_SCORE_PATH, {}),
         "candidates": (BLEND_LOOKUP_PATH, {"candidates": True}),
         "default": (BLEND_LOOKUP_PATH, {})}


# --- a coordinator and its fleet ---------------------------------------------------------------


@contextlib.contextmanager
def coordinator(chunk_size: int, root: Path | None = None) -> Iterator[CoordinatorProcess]:
    """A coordinator process with blend lookup on (`root`: of that checkout, else this one)."""
    here = os.getcwd()
    if root is not None:
        os.chdir(root)  # `python -m coordinator_stub` imports from its working directory
    try:
        process = start_coordinator("--enable-blend-lookup", "--chunk-size", str(chunk_size),
                                    "--log-level", "WARNING")
    finally:
        os.chdir(here)
    try:
        yield process
    finally:
        process.stop()


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (clock ticks, 10 ms on Linux)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def store_entry(chunk_hash: bytes, tokens: np.ndarray, offset: int) -> dict:
    key = {"chunk_hash_hex": chunk_hash.hex(), "model_name": "m", "kv_rank": pack_kv_rank(1),
           "object_group_id": 0, "cache_salt": ""}
    return {"key": key, "size_bytes": 64, "token_ids": tokens.tolist(), "token_offset": offset}


def register_and_store(client: httpx.Client, instance: str, entries: list[dict]) -> None:
    client.post(INSTANCES_PATH, json={"instance_id": instance, "ip": "127.0.0.1",
                                      "http_port": 8080}).raise_for_status()
    batch = {"instance_id": instance, "incarnation": 0, "seq": 1, "event_type": "store",
             "tier": "l1", "backend": "dram", "shared": False, "entries": entries}
    client.post(EVENTS_PATH, json={"batches": [batch]}).raise_for_status()


def repeated_fleet(client: httpx.Client, chunk_size: int, instances: int) -> None:
    """`instances` instances, instance i holding one chunk (hash i + 1) of the repeated token."""
    chunk = np.full(chunk_size, REPEATED_TOKEN, dtype=np.uint32)
    for i in range(instances):
        register_and_store(client, f"inst-{i}", [store_entry((i + 1).to_bytes(32, "big"),
                                                             chunk, 0)])
    time.sleep(0.5)  # ingest applies batches on its own thread


def repeated_body(form: str, tokens: int) -> bytes:
    """The gzipped body of `form` asking for `tokens` of the repeated token."""
    _, extra = FORMS[form]
    query = encode_tokens(np.full(tokens, REPEATED_TOKEN, dtype=np.uint32))
    return gzip.compress(encode({"tokens_b64": query, "model_name": "m", **extra}))


# --- part 1: repeated tokens ------------------------------------------------------------------


def beside_small_lookup(url: str, pid: int, form: str, body: bytes) -> dict:
    """`body` posted to `form`'s path, a small lookup from another client 0.2 s later."""
    small = encode({"tokens_b64": encode_tokens(
        np.arange(SMALL_LOOKUP_TOKENS, dtype=np.uint32) % 50000), "model_name": "m"})
    waited: list[float] = []

    def small_lookup() -> None:
        time.sleep(SMALL_LOOKUP_DELAY_S)
        started = time.monotonic()
        httpx.post(url + BLEND_LOOKUP_PATH, content=small, timeout=120).raise_for_status()
        waited.append(time.monotonic() - started)

    other = threading.Thread(target=small_lookup)
    with httpx.Client(base_url=url, timeout=120) as client:
        other.start()
        cpu, started = cpu_seconds(pid), time.monotonic()
        reply = client.post(FORMS[form][0], content=body, headers={
            "Content-Encoding": "gzip", "Content-Type": "application/json"})
        wall, cpu = time.monotonic() - started, cpu_seconds(pid) - cpu
    other.join()
    decoded = msgspec.json.decode(reply.content) if reply.status_code == 200 else {}
    return {"form": form, "status": reply.status_code, "body": len(body), "cpu": cpu,
            "wall": wall, "reply": len(reply.content), "truncated": decoded.get("truncated",
                                                                                False),
            "small_waited": waited[0]}


def run_repeated(args) -> list[dict]:
    rows = []
    with coordinator(args.chunk_size, args.coordinator_root) as process:
        with httpx.Client(base_url=process.url, timeout=120) as client:
            repeated_fleet(client, args.chunk_size, args.instances)
        for form in FORMS:
            rows.append(beside_small_lookup(process.url, process.process.pid, form,
                                            repeated_body(form, args.tokens)))
    return rows


# --- part 2: one score of every instance against one candidates lookup ----------------------


def musique_workload(chunk_size: int, instances: int, data: Path, questions: int,
                     seed: int) -> tuple[dict[str, list[dict]], list[np.ndarray]]:
    """Each question's prompt stored on instance i mod `instances` under LMCache's chained
    names: (store entries per instance, the queries: each question again, its passages in
    another order)."""
    system, asked = load_musique(data)
    rng = np.random.default_rng(seed)
    stores: dict[str, list[dict]] = {f"inst-{i}": [] for i in range(instances)}
    queries = []
    for i, question in enumerate(asked[:questions]):
        tokens = prompt(system, question.passages, question.question)
        for k, chunk_hash in enumerate(prefix_chunk_hashes(tokens, chunk_size)):
            stores[f"inst-{i % instances}"].append(store_entry(
                chunk_hash, tokens[k * chunk_size:(k + 1) * chunk_size], k * chunk_size))
        order = rng.permutation(len(question.passages))
        queries.append(prompt(system, [question.passages[j] for j in order],
                              question.question))
    return stores, queries


def _bodies(queries: list[np.ndarray]) -> dict[str, list[bytes]]:
    return {form: [encode({"tokens_b64": encode_tokens(q), "model_name": "m",
                           **FORMS[form][1]}) for q in queries]
            for form in ("blend-score", "candidates")}


def run_score_vs_lookup(args) -> dict:
    """CPU per request of a blend score and of a candidates lookup: the coordinator
    process's over HTTP, and in this process without HTTP (`Coordinator.score` and
    `Coordinator.lookup` on the same bodies)."""
    stores, queries = musique_workload(args.score_chunk_size, args.score_instances, args.data,
                                       args.questions, args.seed)
    bodies = _bodies(queries)
    over_http = {form: 0.0 for form in bodies}
    with coordinator(args.score_chunk_size, args.coordinator_root) as process:
        pid = process.process.pid
        with httpx.Client(base_url=process.url, timeout=120) as client:
            for instance, entries in stores.items():
                register_and_store(client, instance, entries)
            time.sleep(1.0)
            for round_ in range(args.rounds):
                for form in (list(bodies) if round_ % 2 == 0 else list(bodies)[::-1]):
                    cpu = cpu_seconds(pid)
                    for body in bodies[form]:
                        client.post(FORMS[form][0], content=body, headers={
                            "Content-Type": "application/json"}).raise_for_status()
                    over_http[form] += cpu_seconds(pid) - cpu
    in_process = _in_process(args, stores, bodies)
    requests = args.rounds * len(queries)
    figures = {"requests": requests}
    for where, spent in (("http", over_http), ("in process", in_process)):
        per = {form: seconds / requests for form, seconds in spent.items()}
        figures[where] = {**per, "ratio": per["blend-score"] / per["candidates"]}
    return figures


def _in_process(args, stores: dict[str, list[dict]], bodies: dict[str, list[bytes]]
                ) -> dict[str, float]:
    """This checkout's `Coordinator`, fed the same events, timed on the same bodies."""
    from blend_wire import EventsRequest, RegisterRequest, decode
    from coordinator_stub.config import CoordinatorConfig
    from coordinator_stub.service.coordinator import Coordinator

    service = Coordinator(CoordinatorConfig(chunk_size=args.score_chunk_size,
                                            enable_blend_lookup=True))
    for instance, entries in stores.items():
        service.register(decode(encode({"instance_id": instance, "ip": "127.0.0.1",
                                        "http_port": 8080}), RegisterRequest))
        batch = {"instance_id": instance, "incarnation": 0, "seq": 1, "event_type": "store",
                 "tier": "l1", "backend": "dram", "shared": False, "entries": entries}
        service.directory.ingest(decode(encode({"batches": [batch]}), EventsRequest).batches)
    answer = {"blend-score": service.score, "candidates": service.lookup}
    spent = {form: 0.0 for form in bodies}
    for round_ in range(args.rounds):
        for form in (list(bodies) if round_ % 2 == 0 else list(bodies)[::-1]):
            cpu = time.process_time()
            for body in bodies[form]:
                encode(answer[form](body))
            spent[form] += time.process_time() - cpu
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--score-chunk-size", type=int, default=64)
    parser.add_argument("--score-instances", type=int, default=64)
    parser.add_argument("--questions", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=MUSIQUE_DATA_DIR)
    parser.add_argument("--coordinator-root", type=Path, default=None,
                        help="run the coordinator of this checkout (default: this one)")
    parser.add_argument("--skip", choices=["repeated", "score"], action="append", default=[])
    args = parser.parse_args()
    print(f"machine: {machine_description()}")
    print(f"coordinator: {args.coordinator_root or 'this checkout'}")
    if "repeated" not in args.skip:
        print(f"\n1. repeated tokens: {args.tokens} tokens of one token, chunk "
              f"{args.chunk_size}, {args.instances} instances holding one chunk each; a "
              f"{SMALL_LOOKUP_TOKENS}-token lookup {SMALL_LOOKUP_DELAY_S} s later")
        print(f"load before: {_load()}")
        print(f"{'form':<12} {'status':>6} {'body B':>8} {'CPU s':>7} {'wall s':>7} "
              f"{'reply B':>10} {'truncated':>9} {'small lookup waited s':>22}")
        for row in run_repeated(args):
            print(f"{row['form']:<12} {row['status']:>6} {row['body']:>8} {row['cpu']:>7.2f} "
                  f"{row['wall']:>7.2f} {row['reply']:>10} "
                  f"{str(row['truncated']) if row['form'] == 'candidates' else '-':>9} "
                  f"{row['small_waited']:>22.2f}")
    if "score" not in args.skip:
        print(f"\n2. score vs lookup: chunk {args.score_chunk_size}, {args.score_instances} "
              f"instances, {args.questions} MuSiQue questions re-asked reordered, "
              f"{args.rounds} rounds")
        print(f"load before: {_load()}")
        figures = run_score_vs_lookup(args)
        print(f"{figures['requests']} requests per form; CPU per request (target: score "
              "<= 2x the lookup)")
        for where in ("http", "in process"):
            row = figures[where]
            label = ("coordinator process, over HTTP" if where == "http" else
                     "this checkout's Coordinator in process, no HTTP")
            print(f"  {label}: blend score {row['blend-score'] * 1e3:.3f} ms, candidates "
                  f"lookup {row['candidates'] * 1e3:.3f} ms, ratio {row['ratio']:.2f}x")
    print(f"\nload after: {_load()}")


def _load() -> str:
    with open("/proc/loadavg") as loadavg:
        return " ".join(loadavg.read().split()[:3])


if __name__ == "__main__":
    main()
