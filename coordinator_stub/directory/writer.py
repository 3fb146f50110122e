"""The directory's only path to the blend index (`local_matcher.ContentIndex`): updates
are queued while a batch applies and sent once it is done, so a failed batch sends
nothing, or says what to repair (docs/DESIGN.md, "Key directory internals").
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from blend_wire import BlendNamespace

_ALL = object()  # `IndexWriter._latest`: every claim of the chunk
_ADDS, _REMOVE_CLAIM, _REMOVE_CHUNK = "adds", "remove_claim", "remove_chunk"


class IndexWriter:
    """The directory's only path to the index. Updates are queued and sent by `flush()`,
    consecutive adds (`add`s and `add_rows` blocks alike) as one `add_many` (one lock
    acquisition, one kernel call; one namespace for them all when they have one) instead
    of one call per chunk; `discard()` drops what is queued.

    Order is preserved: adds are sent in the order they were queued (the index numbers
    occupants in the order they are first indexed, LMCache's match order), and every
    removal closes the current run of adds first. While updates are queued, `tokens_of`
    answers as the index will once they are sent.

    `flush()` records, with each removal, the tokens the claims had (`replaced`, by
    `(chunk_hash, namespace)`: what `remove_claim` returns; or by chunk hash for a whole
    chunk, read before it goes), so a failure part-way can be repaired; `sent` says how many updates of a flush that failed reached the index
    (0 once a flush completes: a batch that fails before its flush sent nothing).
    Called only under the directory lock, and flushed before the lock is released.
    """

    def __init__(self, index, chunk_size: int) -> None:
        self.index = index
        self.chunk_size = chunk_size
        # Removals, and runs of adds: each a list of parts, `add`s (four lists: tokens,
        # chunk hashes, offsets, namespaces) or `add_rows` blocks (rows, chunk hashes,
        # offsets, namespace).
        self._ops: list[tuple] = []
        self._adds: list | None = None  # the run of adds being queued
        # Per chunk hash, the content of each namespace's claim once queued updates land
        # (None: no claim); `_ALL` present: the chunk was dropped, so unlisted ones too.
        self._latest: dict[bytes, dict] = {}
        # The `add_rows` blocks not yet in `_latest` (`_fold_rows`), and their hashes
        # (None: not gathered yet; a batch of runs alone never needs them).
        self._unread: list[tuple] = []
        self._unread_hashes: set[bytes] | None = None
        self.sent = 0
        self.replaced: dict = {}

    def add(self, tokens: bytes, chunk_hash: bytes, offset: int,
            namespace: BlendNamespace) -> None:
        self._fold_rows(chunk_hash)
        self._latest.setdefault(chunk_hash, {})[namespace] = tokens
        adds = self._open_adds()
        if not adds or type(adds[-1]) is not list:
            adds.append([[], [], [], []])
        part = adds[-1]
        part[0].append(tokens)
        part[1].append(chunk_hash)
        part[2].append(offset)
        part[3].append(namespace)

    def add_rows(self, rows: np.ndarray, chunk_hashes: list[bytes], offsets: np.ndarray,
                 namespace: BlendNamespace) -> None:
        """`add` of each row of a (n, chunk_size) uint32 array at its offset (known: >= 0),
        all for one namespace, queued as one block (not copied: leave the rows as they
        are)."""
        block = (rows, chunk_hashes, offsets, namespace)
        self._open_adds().append(block)
        self._unread.append(block)
        if self._unread_hashes is not None:
            self._unread_hashes.update(chunk_hashes)

    def _open_adds(self) -> list:
        if self._adds is None:
            self._adds = []
            self._ops.append((_ADDS, self._adds, None))
        return self._adds

    def _fold_rows(self, chunk_hash: bytes) -> None:
        """Before anything reads or changes what `_latest` holds of `chunk_hash`: if a
        block queued since the last fold has it, record every such block's rows there
        (`_latest` must hold every update of a chunk, in order). A bulk run's chunks are
        new to the directory, so the rest of their batch rarely names them: a fold is
        rare, and costs a bytes object per row."""
        if not self._unread:
            return
        if self._unread_hashes is None:
            self._unread_hashes = set(chain.from_iterable(block[1] for block in self._unread))
        if chunk_hash not in self._unread_hashes:
            return
        for rows, hashes, _, namespace in self._unread:
            for chunk_hash, row in zip(hashes, rows):
                self._latest.setdefault(chunk_hash, {})[namespace] = row.tobytes()
        self._unread, self._unread_hashes = [], None

    def remove_claim(self, chunk_hash: bytes, namespace: BlendNamespace) -> None:
        self._fold_rows(chunk_hash)
        self._adds = None
        self._ops.append((_REMOVE_CLAIM, chunk_hash, namespace))
        self._latest.setdefault(chunk_hash, {})[namespace] = None

    def remove_chunk(self, chunk_hash: bytes) -> None:
        self._fold_rows(chunk_hash)
        self._adds = None
        self._ops.append((_REMOVE_CHUNK, chunk_hash, None))
        self._latest[chunk_hash] = {_ALL: None}

    def tokens_of(self, chunk_hash: bytes, namespace: BlendNamespace | None = None
                  ) -> bytes | None:
        """The content of `namespace`'s claim (None: of any claim, for a chunk whose
        claims all agree) as it will be once the queue is sent."""
        self._fold_rows(chunk_hash)
        latest = self._latest.get(chunk_hash)
        if latest is not None:
            if namespace is None:
                for tokens in latest.values():
                    if tokens is not None:
                        return tokens
            elif namespace in latest:
                return latest[namespace]
            if _ALL in latest:
                return None
        tokens = self.index.tokens_of(chunk_hash, namespace)
        return None if tokens is None else np.asarray(tokens, dtype=np.uint32).tobytes()

    def flush(self) -> None:
        """Send every queued update to the index, in order."""
        ops = self._ops
        self.discard()
        self.replaced = {}
        index = self.index
        for kind, first, second in ops:
            if kind is _ADDS:
                self._send_adds(first)
            elif kind is _REMOVE_CLAIM:  # what it had, to restore should this flush fail
                self.replaced.setdefault((first, second), index.remove_claim(first, second))
            else:
                if first not in self.replaced:
                    self.replaced[first] = index.tokens_of(first)
                index.remove_chunk(first)
            self.sent += 1
        self.sent = 0  # all sent: nothing for a later failure to repair

    def _send_adds(self, parts: list) -> None:
        """A run of adds as one `add_many`: every row once (a chunk claimed for every
        namespace on it queues the same bytes n times, hashed and looked up once), one
        namespace for all when they have one (the index claims such runs in bulk)."""
        if len(parts) == 1 and type(parts[0]) is tuple:  # one block: as it is
            self.index.add_many(*parts[0])
            return
        rows, row_of, first_row = [], [], 0
        for part in parts:
            if type(part) is list:  # `add`s: one row per distinct tokens object
                row_numbers: dict[int, int] = {}
                distinct: list[bytes] = []
                for tokens in part[0]:
                    row = row_numbers.get(id(tokens))
                    if row is None:
                        row = row_numbers[id(tokens)] = len(distinct)
                        distinct.append(tokens)
                    row_of.append(first_row + row)
                rows.append(np.frombuffer(b"".join(distinct), dtype=np.uint32).reshape(
                    len(distinct), self.chunk_size))
            else:  # an `add_rows` block
                row_of += range(first_row, first_row + len(part[0]))
                rows.append(part[0])
            first_row += len(rows[-1])
        namespaces = list(chain.from_iterable(
            part[3] if type(part) is list else [part[3]] * len(part[1]) for part in parts))
        first = namespaces[0]
        self.index.add_many(
            rows[0] if len(rows) == 1 else np.concatenate(rows),
            list(chain.from_iterable(part[1] for part in parts)),
            np.concatenate([np.asarray(part[2], dtype=np.int64) for part in parts]),
            first if namespaces.count(first) == len(namespaces) else namespaces,
            row_of if first_row < len(row_of) else None)

    def discard(self) -> int:
        """Drop every queued update (the batch that queued them was rolled back); how many
        updates of its flush had reached the index (0: it failed before its flush)."""
        self._ops, self._adds, self._latest = [], None, {}
        self._unread, self._unread_hashes = [], None
        sent, self.sent = self.sent, 0
        return sent
