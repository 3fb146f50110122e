"""Helpers of the hostile-client tests (issue 11): a valid STORE entry by default, so a test
breaks exactly one field. Built on the shared coordinator test helpers (coordinator_client);
the in-process coordinator (chunk size 4, so A and B are one chunk each) comes from the
`start` / `coord` fixtures of tests/conftest.py."""

from __future__ import annotations

from coordinator_client import batch
from coordinator_client import entry as _entry

__all__ = ["A", "B", "batch", "entry"]

A = [11, 12, 13, 14]
B = [21, 22, 23, 24]


def entry(chunk_hash: str = "aa01", tokens=A, offset: int = 0, size_bytes: int = 64,
          **key_fields) -> dict:
    """A STORE entry of chunk A at offset 0 unless told otherwise (`kv_rank=` as is)."""
    return _entry(chunk_hash, tokens, offset, size_bytes, **key_fields)
