"""The key directory: where every stored object lives and what content each chunk holds,
with the blend index derived from it (docs/DESIGN.md, "Key directory internals"), and the
end of ingest: the gate and the consumers (`pipeline.py`)."""

from coordinator_stub.directory.gate import Verdict
from coordinator_stub.directory.key_directory import KeyDirectory
from coordinator_stub.directory.pipeline import Tally

__all__ = ["KeyDirectory", "Tally", "Verdict"]
