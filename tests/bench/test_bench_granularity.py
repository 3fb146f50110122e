"""`make bench-granularity --quick`: the reuse table against chunk size and its price, on
the real MuSiQue prompts and coordinator processes; what must hold whatever the machine."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.bench_granularity import Row, StorePrice, invariants, measure, parse_args, table
from benchmarks.bench_rag import Run, chunk_sizes

LANE = "coordinator"


def test_quick_run_keeps_the_reuse_order_and_prices_every_size(capsys):
    args = parse_args(["--quick"])
    rows = measure(args)
    assert [r.chunk for r in rows] == [64, 32]
    assert invariants(rows) == []
    for row in rows:
        for name in ("A", "B"):
            run = row.runs[name]
            reused = {s: sum(run.reused[s]) for s in ("ceiling", "once", "unified", "fleet")}
            assert reused["ceiling"] >= reused["once"] >= reused["unified"] >= reused["fleet"] > 0
            assert run.percent("ceiling") <= 100.0
            assert run.cpu_plugin_ms > 0
            # Both candidates forms name the same chunks and positions; the columns fewer bytes.
            objects, columns = run.forms["objects"], run.forms["columns"]
            assert (columns.chunks_named, columns.positions_found) == (
                objects.chunks_named, objects.positions_found) and columns.chunks_named > 0
            assert columns.reply_bytes < objects.reply_bytes / 2
            assert all(form.lookups > 0 and form.plugin_cpu_s > 0 for form in run.forms.values())
        # Every stored token crossed the wire once as a JSON token id (>= 2 bytes each).
        assert row.store.event_bytes >= 2
        assert row.store.stored_tokens % row.chunk == 0 and row.store.stored_tokens > 0
        assert row.store.ingest_us > 0 and row.store.store_path_us > 0
    # The ceiling does not depend on the chunk grid (the prefix coverage aside).
    assert abs(rows[0].runs["A"].percent("ceiling") - rows[1].runs["A"].percent("ceiling")) < 1
    lines = table(rows, ["A", "B"])
    assert len(lines) == 2 + len(rows) and all(line.count("|") == lines[0].count("|")
                                               for line in lines)


def test_invariants_name_a_run_that_reuses_more_than_its_oracle():
    run = Run("A", 64, queries=1, prompt_tokens=100)
    for system, reused in (("ceiling", 90), ("once", 50), ("unified", 60), ("fleet", 40)):
        run.reused[system].append(reused)
    row = Row(64, runs={"A": run}, store=StorePrice(640, 5.0, 0.1, 0.2, 7.0))
    broken = invariants([row])
    assert len(broken) == 1 and "A/64" in broken[0]


def test_chunk_sizes_take_a_comma_list_and_refuse_nonsense():
    assert chunk_sizes("256,64,32") == [256, 64, 32]
    assert chunk_sizes("16") == [16]
    for bad in ("", "0", "64,x", "-32"):
        with pytest.raises(argparse.ArgumentTypeError):
            chunk_sizes(bad)
