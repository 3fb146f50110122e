"""The MuSiQue subset the benchmarks run on is shipped, and its token file is what
`python -m benchmarks.musique_data` builds from the shipped source (benchmarks/data/musique/)."""

from __future__ import annotations

import pytest

from benchmarks.bench_rag import load_musique
from benchmarks.musique_data import (MUSIQUE_DATA_DIR, build_tokens, read_source, read_tokens,
                                     tokenizer)

LANE = "unit"

ROOT = MUSIQUE_DATA_DIR.parents[2]


def test_the_data_is_inside_the_checkout_and_loads():
    assert MUSIQUE_DATA_DIR.is_relative_to(ROOT), MUSIQUE_DATA_DIR
    system, questions = load_musique(MUSIQUE_DATA_DIR)
    assert len(questions) == 150 and len(system) > 0
    assert all(len(q.passages) == 10 for q in questions)
    readme = (MUSIQUE_DATA_DIR / "README.md").read_text()
    for fact in ("YaoJiayi/CacheBlend", "inputs/musique_s.json", "CC BY 4.0",
                 "python -m benchmarks.musique_data"):
        assert fact in readme, fact


@pytest.mark.parametrize("index", [0, 1, 77, 149])
def test_the_shipped_token_file_is_what_the_rebuild_script_makes(index):
    source, shipped = read_source(), read_tokens()
    assert len(source) == len(shipped["questions"]) == 150
    built = build_tokens([source[index]], tokenizer())
    assert built["encoding"] == shipped["encoding"]
    assert built["system"] == shipped["system"]
    assert built["questions"] == [shipped["questions"][index]]
