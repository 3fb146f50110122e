"""The key directory: where every stored object lives and what content each chunk holds,
with the blend index derived from it (docs/DESIGN.md, "Key directory internals")."""

from coordinator_stub.directory.key_directory import KeyDirectory

__all__ = ["KeyDirectory"]
