"""`make bench-lookup-forms`, smallest run: both sizes' coordinators answer every form, the
table has every size and form, the ratios are printed."""

from __future__ import annotations

from benchmarks.bench_lookup_forms import main

LANE = "coordinator"


def test_a_small_run_prices_every_form_at_both_sizes(capsys):
    assert main(["--queries", "3", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| B |")]
    assert [row.split(" | ")[1:3] for row in rows] == [
        [size, form] for size in ("256", "32") for form in ("default", "objects", "columns")]
    assert "chunk 32 / chunk 256, same form, same run:" in out
