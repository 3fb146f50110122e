"""The key directory applying the STORE batches real fleets send, in process: CPU µs per
ingested chunk (`KeyDirectory.ingest`, gating to index adds; no HTTP, no decoding).

A multi-tenant server's reporter puts consecutive STOREs in one batch whatever their tenant,
so a batch is runs of requests (sequences of `--chunks-per-sequence` prefix-chained chunks),
each of one of `--tenants` cache salts. `--restored` of the sequences name chunks stored
before (a re-stored prefix: the same hashes, tokens and offsets, from either instance);
`--cross-tenant` of those under another tenant's salt (a prefix whose chunk hashes several
tenants share: WIRE.md), and `--shared-text` of the new ones carry an earlier sequence's
text behind a new first chunk (RAG: the same passage behind another prefix, so known
content under new hashes).

`--deletes` then DELETEs every stored key, batch by batch (an instance evicting what it
stored), and gives the CPU per deleted entry too.

`--against REV` measures the code of git revision REV too: each round runs this script on
both trees (`git archive`), alternating, one process each, and the table gives the medians
(the machine is shared: read the ratio, with the load printed beside it).

    python -m benchmarks.bench_directory_batches [--chunks 40000] [--deletes] [--against main]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-model"
VOCAB = 128_000


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=40_000, help="STORE entries in all")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--chunks-per-sequence", type=int, default=16)
    parser.add_argument("--batch-entries", type=int, default=512)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--restored", type=float, default=0.1,
                        help="share of sequences that re-store an earlier one")
    parser.add_argument("--cross-tenant", type=float, default=0.0,
                        help="share of re-stored sequences stored under another tenant")
    parser.add_argument("--shared-text", type=float, default=0.0,
                        help="share of new sequences carrying an earlier one's text")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deletes", action="store_true",
                        help="then DELETE every stored key, batch by batch, and measure that "
                             "too (CPU us per deleted entry)")
    parser.add_argument("--against", metavar="REV", help="also measure git revision REV")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_bodies(args: argparse.Namespace) -> list[bytes]:
    """The `/events` bodies, one batch each, in the order they are sent."""
    from blend_wire import encode, pack_kv_rank

    rng = np.random.default_rng(args.seed)
    per_seq, size = args.chunks_per_sequence, args.chunk_size
    sequences: list[tuple[int, list[str], np.ndarray]] = []  # (tenant, hashes, tokens)
    entries_of = {0: [], 1: []}  # per instance, its entries waiting for a batch
    bodies, seqs, sent = [], {0: 0, 1: 0}, 0
    while sent < args.chunks:
        instance = int(rng.integers(2))
        if sequences and rng.random() < args.restored:
            tenant, hashes, tokens = sequences[int(rng.integers(len(sequences)))]
            if args.tenants > 1 and rng.random() < args.cross_tenant:
                tenant = (tenant + 1 + int(rng.integers(args.tenants - 1))) % args.tenants
        else:
            tenant = int(rng.integers(args.tenants))
            tokens = rng.integers(0, VOCAB, (per_seq, size), dtype=np.uint32)
            if sequences and rng.random() < args.shared_text:
                tokens[1:] = sequences[int(rng.integers(len(sequences)))][2][1:]
            hashes, previous = [], b""
            for row in tokens:  # prefix-chained, as a serving process's chunk hashes
                previous = hashlib.blake2b(previous + row.tobytes(), digest_size=16).digest()
                hashes.append(previous.hex())
            sequences.append((tenant, hashes, tokens))
        entries_of[instance].extend({
            "key": {"chunk_hash_hex": h, "model_name": MODEL, "kv_rank": pack_kv_rank(1),
                    "object_group_id": 0, "cache_salt": f"t{tenant}"},
            "size_bytes": 1 << 20, "token_ids": tokens[i].tolist(),
            "token_offset": i * size} for i, h in enumerate(hashes))
        sent += len(hashes)
        if len(entries_of[instance]) >= args.batch_entries or sent >= args.chunks:
            seqs[instance] += 1
            bodies.append(encode({"instance_id": f"server-{instance}", "incarnation": 0,
                                  "seq": seqs[instance], "event_type": "store",
                                  "tier": "l1", "backend": "dram",
                                  "entries": entries_of[instance]}))
            entries_of[instance] = []
    return bodies


def measure(args: argparse.Namespace) -> dict:
    """One round on the code this process imports: CPU µs per entry applied."""
    from blend_wire import CacheEventBatch, decode
    from coordinator_stub.directory import KeyDirectory

    bodies = build_bodies(args)
    warm_up = KeyDirectory(chunk_size=args.chunk_size, enable_blend_lookup=True)
    warm_up.ingest([decode(body, CacheEventBatch) for body in bodies[:4]])  # kernels loaded
    batches = [decode(body, CacheEventBatch) for body in bodies]
    directory = KeyDirectory(chunk_size=args.chunk_size, enable_blend_lookup=True)
    gc.set_threshold(50_000, 20, 10)  # as the coordinator process runs (its __main__)
    gc.freeze()
    entries = cpu = 0.0
    for batch in batches:
        started = time.thread_time()
        directory.ingest([batch])
        cpu += time.thread_time() - started
        entries += len(batch.entries)
    stats = directory.stats()
    figures = {"us_per_chunk": cpu / entries * 1e6, "bindings": stats["num_bindings"],
               "placements": stats["num_placements"], "claims": stats["blend"]["num_claims"],
               "contents": stats["blend"]["num_contents"]}
    if args.deletes:
        cpu = 0.0
        for batch in [decode(body, CacheEventBatch) for body in _deletes_of(bodies)]:
            started = time.thread_time()
            directory.ingest([batch])
            cpu += time.thread_time() - started
        figures["us_per_deleted"] = cpu / entries * 1e6
        figures["left"] = directory.stats()["num_bindings"]
    return figures


def _deletes_of(bodies: list[bytes]) -> list[bytes]:
    """A DELETE of every key the STORE `bodies` stored, one batch per body, each
    instance's sequence numbers going on from its stores'."""
    import msgspec

    parsed = [msgspec.json.decode(body) for body in bodies]
    last = {}
    for batch in parsed:
        last[batch["instance_id"]] = max(last.get(batch["instance_id"], 0), batch["seq"])
    deletes = []
    for batch in parsed:
        last[batch["instance_id"]] += 1
        entries = [{**entry, "token_ids": []} for entry in batch["entries"]]
        deletes.append(msgspec.json.encode({**batch, "event_type": "delete", "entries": entries,
                                            "seq": last[batch["instance_id"]]}))
    return deletes


def run_round(tree: Path, argv: list[str]) -> dict:
    """One round in a process of its own, on the code of `tree`."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *argv, "--worker"], cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)}, check=True, capture_output=True,
        text=True)
    return json.loads(done.stdout.splitlines()[-1])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args)))
        return 0
    load_before = os.getloadavg()[0]
    trees = {"this tree": ROOT}
    with tempfile.TemporaryDirectory() as scratch:
        if args.against:
            old = Path(scratch) / "old"
            old.mkdir()
            archive = subprocess.run(["git", "archive", args.against], cwd=ROOT, check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            trees = {args.against: old, **trees}
        worker_argv = [a for i, a in enumerate(argv)
                       if a != "--against" and (i == 0 or argv[i - 1] != "--against")]
        figures = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                figures[name].append(run_round(tree, worker_argv))
    print(f"{args.chunks:,} STORE entries of {args.chunk_size} tokens, batches of "
          f"{args.batch_entries}, {args.tenants} tenants in runs of "
          f"{args.chunks_per_sequence}, {args.restored:.0%} re-stored sequences "
          f"({args.cross_tenant:.0%} by another tenant), {args.shared_text:.0%} shared text; "
          f"load {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
    for figure, what in (("us_per_chunk", "stored"), ("us_per_deleted", "deleted")):
        if figure not in figures[next(iter(figures))][0]:
            continue
        medians = {}
        for name, rounds in figures.items():
            values = [r[figure] for r in rounds]
            medians[name] = statistics.median(values)
            state = {k: v for k, v in rounds[0].items() if not k.startswith("us_per")}
            print(f"  {name:<12} {medians[name]:6.2f} us per {what} entry (median of "
                  f"{', '.join(f'{v:.2f}' for v in values)})  {state}")
        if len(medians) == 2:
            old, new = medians.values()
            print(f"  ratio {old / new:.2f}x less CPU per {what} entry")
    return 0


if __name__ == "__main__":
    sys.exit(main())
