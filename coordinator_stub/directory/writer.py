"""The directory's only path to the blend index (`local_matcher.ContentIndex`): updates
are queued while a batch applies and sent once it is done, so a failed batch sends
nothing, or says what to repair (docs/DESIGN.md, "Key directory internals").
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from blend_wire import BlendNamespace

_ALL = object()  # `IndexWriter._latest`: every claim of the chunk
_ADD_MANY, _ADD_ROWS = "add_many", "add_rows"
_REMOVE_CLAIM, _REMOVE_CHUNK = "remove_claim", "remove_chunk"


class IndexWriter:
    """The directory's only path to the index. Updates are queued and sent by `flush()`,
    consecutive adds as one `add_many` (one lock acquisition, one kernel call; one
    namespace for them all when they have one) instead of one call per chunk, and
    consecutive blocks of `add_rows` as one `add_many` of their own; `discard()` drops what
    is queued.

    Order is preserved: adds are sent in the order they were queued (the index numbers
    occupants in the order they are first indexed, LMCache's match order), and every
    removal closes the current run of adds first. While updates are queued, `tokens_of`
    answers as the index will once they are sent.

    `flush()` records, before each removal, the tokens the claims had (`replaced`, by
    `(chunk_hash, namespace)`, or by chunk hash for a whole chunk), so a failure part-way
    can be repaired; `sent` says how many updates of a flush that failed reached the index
    (0 once a flush completes: a batch that fails before its flush sent nothing).
    Called only under the directory lock, and flushed before the lock is released.
    """

    def __init__(self, index, chunk_size: int) -> None:
        self.index = index
        self.chunk_size = chunk_size
        self._ops: list[tuple] = []
        # Per chunk hash, the content of each namespace's claim once queued updates land
        # (None: no claim); `_ALL` present: the chunk was dropped, so unlisted ones too.
        self._latest: dict[bytes, dict] = {}
        self._adds: tuple[list, list, list, list] | None = None
        # The chunk hashes of the `add_rows` blocks not yet in `_latest` (`_fold_rows`),
        # queued from `_ops[_unread_from]` on.
        self._unread: set[bytes] = set()
        self._unread_from = 0
        self.sent = 0
        self.replaced: dict = {}

    def add(self, tokens: bytes, chunk_hash: bytes, offset: int,
            namespace: BlendNamespace) -> None:
        self._fold_rows(chunk_hash)
        self._latest.setdefault(chunk_hash, {})[namespace] = tokens
        adds = self._adds
        if adds is None:
            adds = self._adds = ([], [], [], [])
        adds[0].append(tokens)
        adds[1].append(chunk_hash)
        adds[2].append(offset)
        adds[3].append(namespace)

    def add_rows(self, rows: np.ndarray, chunk_hashes: list[bytes], offsets: np.ndarray,
                 namespace: BlendNamespace) -> None:
        """`add` of each row of a (n, chunk_size) uint32 array at its offset (known: >= 0),
        all for one namespace, queued as one block (not copied: leave the rows as they
        are)."""
        self._close_adds()
        self._ops.append((_ADD_ROWS, namespace, (rows, chunk_hashes, offsets)))
        if not self._unread:
            self._unread_from = len(self._ops) - 1
        self._unread.update(chunk_hashes)

    def _fold_rows(self, chunk_hash: bytes) -> None:
        """Before anything reads or changes what `_latest` holds of `chunk_hash`: if a
        block queued since the last fold has it, record every such block's rows there
        (`_latest` must hold every update of a chunk, in order). A bulk run's chunks are
        new to the directory, so the rest of their batch rarely names them: a fold is
        rare, and costs a bytes object per row."""
        if chunk_hash not in self._unread:
            return
        for kind, namespace, block in self._ops[self._unread_from:]:
            if kind is _ADD_ROWS:
                for chunk_hash, row in zip(block[1], block[0]):
                    self._latest.setdefault(chunk_hash, {})[namespace] = row.tobytes()
        self._unread = set()

    def remove_claim(self, chunk_hash: bytes, namespace: BlendNamespace) -> None:
        self._fold_rows(chunk_hash)
        self._close_adds()
        self._ops.append((_REMOVE_CLAIM, chunk_hash, namespace))
        self._latest.setdefault(chunk_hash, {})[namespace] = None

    def remove_chunk(self, chunk_hash: bytes) -> None:
        self._fold_rows(chunk_hash)
        self._close_adds()
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

    def _close_adds(self) -> None:
        if self._adds is not None:
            self._ops.append((_ADD_MANY, None, self._adds))
            self._adds = None

    def flush(self) -> None:
        """Send every queued update to the index, in order."""
        self._close_adds()
        ops, self._ops, self._latest, self._unread = self._ops, [], {}, set()
        self.sent, self.replaced = 0, {}
        index = self.index
        blocks: list[tuple] = []  # consecutive `add_rows` blocks, sent as one
        for kind, first, second in ops:
            if kind is _ADD_ROWS:
                blocks.append((first, second))
                continue
            if blocks:
                self._send_rows(blocks)
                blocks = []
            if kind is _ADD_MANY:
                self._send_adds(*second)
            elif kind is _REMOVE_CLAIM:
                if (first, second) not in self.replaced:  # to restore should this fail
                    self.replaced[(first, second)] = index.tokens_of(first, second)
                index.remove_claim(None, first, second)
            else:
                if first not in self.replaced:
                    self.replaced[first] = index.tokens_of(first)
                index.remove_chunk(None, first)
            self.sent += 1
        if blocks:
            self._send_rows(blocks)
        self.sent = 0  # all sent: nothing for a later failure to repair

    def _send_adds(self, contents: list[bytes], hashes: list, offsets: list,
                   namespaces: list) -> None:
        """A run of `add`s as one `add_many`."""
        # One row per distinct tokens object: a chunk claimed for every namespace on it
        # queues the same bytes n times, hashed and looked up once here.
        row_numbers: dict[int, int] = {}
        distinct: list[bytes] = []
        row_of = []
        for tokens in contents:
            row = row_numbers.get(id(tokens))
            if row is None:
                row = row_numbers[id(tokens)] = len(distinct)
                distinct.append(tokens)
            row_of.append(row)
        rows = np.frombuffer(b"".join(distinct), dtype=np.uint32).reshape(
            len(distinct), self.chunk_size)
        # One namespace for all (the common run) lets the index claim them in bulk.
        first = namespaces[0]
        self.index.add_many(rows, hashes, offsets,
                            first if namespaces.count(first) == len(namespaces)
                            else namespaces,
                            row_of if len(distinct) < len(contents) else None)

    def _send_rows(self, blocks: list[tuple]) -> None:
        """Consecutive `add_rows` blocks (runs of a batch's keys) as one `add_many`."""
        if len(blocks) == 1:
            namespace, (rows, hashes, offsets) = blocks[0]
        else:
            rows = np.concatenate([block[0] for _, block in blocks])
            hashes = list(chain.from_iterable(block[1] for _, block in blocks))
            offsets = np.concatenate([block[2] for _, block in blocks])
            namespace = blocks[0][0]
            if any(other != namespace for other, _ in blocks):
                namespace = []
                for name, block in blocks:
                    namespace += [name] * len(block[1])
        self.index.add_many(rows, hashes, offsets, namespace)
        self.sent += 1

    def discard(self) -> int:
        """Drop every queued update (the batch that queued them was rolled back); how many
        updates of its flush had reached the index (0: it failed before its flush)."""
        self._ops, self._latest, self._adds, self._unread = [], {}, None, set()
        sent, self.sent = self.sent, 0
        return sent
