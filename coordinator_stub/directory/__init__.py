"""The key directory: where every stored object lives and what content each chunk holds."""

from coordinator_stub.directory.key_directory import KeyDirectory

__all__ = ["KeyDirectory"]
