"""Numba kernels of the content store: fingerprints, probing, insertion, removal.

Plain-array signatures only; `local_matcher.store.ContentStore` owns the arrays and
is the only caller. Every kernel is compiled with ``cache=True``. `probe`, the long one,
also releases the GIL (callers hold the store's lock); the short update kernels keep
it, since releasing and re-taking the GIL around a few microseconds of work makes the
threads that share it queue behind each other.

Fingerprint of a window of C tokens (all arithmetic mod 2**64)::

    mix(x, K) = y ^ (y >> 32), where y = x * K    # K1, K2: fixed odd constants
    v_i = mix(token_i + salt, K1)                 # per-token scramble, keyed per process
    h   = sum_j v_{p+j} * base**(C-1-j)           # polynomial, rolled one token at a time
    fp  = mix(h ^ salt, K2)

`mix` is one multiply with the high half folded into the low: a bijection at a third of the
cost of a full mixer (splitmix64's finaliser, used before; pass 1 of a probe is most of its
arithmetic). It is enough here: the scrambled terms already spread h over all 64 bits, and
the multiply carries every bit of its input into the top bits, which pick the table slot and
the filter word, while the fold brings them down to the low bits, which pick the filter's
bits. `salt` and the odd `base`
are drawn at random per process, so fingerprints never leave the process and collisions
cannot be precomputed. Collisions still cost nothing but time: every candidate is compared
token by token. A probe makes each window's fingerprint and prefetches its filter word in
one pass (the filter loads overlap the rolling arithmetic), tests the filter in a second,
and looks the windows that pass up in the table in a third, prefetching each candidate's
stored row, which a fourth compares.

Table layout (the invariants every kernel keeps):

- ``table[3s:3s+3]`` (uint32): slot s's fingerprint, low word then high, and content id
  + 1 (0: empty), side by side so that a probe reads one cache line (mostly: 12 bytes a
  slot), 12 bytes instead of the 16 of two 64-bit words. Open addressing with linear probing over
  any number of slots (the store sizes it by what it holds, not to a power of two); an
  entry's home slot is its fingerprint's top 32 bits scaled to the table (`_home`: a
  multiply and a shift, monotone in the fingerprint). Several entries may share a
  fingerprint (different contents): it is a multimap. Deletion shifts later entries back,
  so there are no tombstones.
- ``filter_words``: a blocked filter of a power of two words (the top ``word_bits`` bits
  of a fingerprint pick the word), in which each entry sets three bits picked by its
  fingerprint's low bits; a probe passes when its three bits are set (one memory access).
  Since homes are monotone in the fingerprint, a word's entries have their homes in one
  run of slots (`_word_run`); a word holds exactly the bits of the live entries of its
  run: those sit in the run or in the cluster running on from its end, so removal
  recomputes the word from there.
- ``blocks[cid >> BLOCK_BITS][cid & BLOCK_MASK]``: the content's tokens, in fixed-size
  blocks so that growing never copies them, three bytes a token or four (`_token` reads
  either); ``free_ids[:id_counts[0]]`` the removed contents' ids, to be taken again
  before ``id_counts[1]``, the first id never handed out.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.typed import List

from local_matcher import content_groups
from local_matcher.head_table import other_head

_SCRAMBLE_FACTOR = np.uint64(0x9E3779B97F4A7C15)
_FINISH_FACTOR = np.uint64(0xBF58476D1CE4E5B9)
_S32 = np.uint64(32)
_ONE = np.uint64(1)
_SIX = np.uint64(6)
_TWELVE = np.uint64(12)
_LOW6 = np.uint64(63)
_LOW32 = np.uint64(0xFFFFFFFF)

BLOCK_BITS = 14
BLOCK_ROWS = 1 << BLOCK_BITS
_BLOCK_MASK = BLOCK_ROWS - 1


@njit(cache=True)
def new_blocks(first):
    """A typed list of token blocks holding `first`. Built here, in a cached kernel, and
    only grown by `append_block`: a typed list created or used from Python compiles its
    methods anew in every process (seconds at start-up), a cached kernel loads them."""
    blocks = List()
    blocks.append(first)
    return blocks


@njit(cache=True)
def append_block(blocks, block):
    blocks.append(block)


@njit(cache=True, inline="always")
def _mix(x, factor):
    """One multiply (which carries every input bit into all the bits above it), then the
    high half folded into the low: a cheap bijection of 64-bit words (the module doc says
    why it is enough)."""
    x = x * factor
    return x ^ (x >> _S32)


@njit(cache=True, inline="always")
def _scramble(token, salt):
    return _mix(np.uint64(token) + salt, _SCRAMBLE_FACTOR)


@njit(cache=True, inline="always")
def _finish(h, salt):
    return _mix(h ^ salt, _FINISH_FACTOR)


@njit(cache=True, inline="always")
def _row(blocks, cid):
    return blocks[cid >> BLOCK_BITS][cid & _BLOCK_MASK]


@intrinsic
def _prefetch(typingctx, array_, index):
    """Ask the CPU to start loading the cache line of ``array_[index]`` (no result)."""
    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        array_value = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, array_type, array_value,
                                           [args[1]], wraparound=False)
        byte_pointer, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]),
            "llvm.prefetch.p0i8")
        # A read, kept in every cache level, of data (not instructions).
        builder.call(prefetch, [builder.bitcast(pointer, byte_pointer), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.void(array_, index), codegen


@njit(cache=True, inline="always")
def _prefetch_row(row):
    for j in range(0, row.shape[0], 64 // row.itemsize):  # one 64-byte cache line each
        _prefetch(row, j)
    _prefetch(row, row.shape[0] - 1)  # the last line, should the row not start a line


# A row of tokens is uint32 (a query, rows to insert, a wide store's blocks) or packed:
# three little-endian bytes per token (a store's blocks while every id is below
# PACKED_TOKEN_LIMIT). `row.itemsize` is a constant of each compiled specialisation, so
# each compiles to one branch.
PACKED_TOKEN_LIMIT = 1 << 24


@njit(cache=True, inline="always")
def _width(row):
    """Tokens in a row."""
    return row.shape[0] // 3 if row.itemsize == 1 else row.shape[0]


@njit(cache=True, inline="always")
def _token(row, j):
    if row.itemsize == 1:
        k = 3 * j
        return (np.uint32(row[k]) | (np.uint32(row[k + 1]) << np.uint32(8))
                | (np.uint32(row[k + 2]) << np.uint32(16)))
    return np.uint32(row[j])


@njit(cache=True, inline="always")
def _put_row(stored, tokens):
    """Store a uint32 row into a block's row (packed or not)."""
    if stored.itemsize == 1:
        for j in range(tokens.shape[0]):
            t = tokens[j]
            stored[3 * j] = t & 0xFF
            stored[3 * j + 1] = (t >> 8) & 0xFF
            stored[3 * j + 2] = (t >> 16) & 0xFF
    else:
        for j in range(tokens.shape[0]):
            stored[j] = tokens[j]


@njit(cache=True, inline="always")
def _fingerprint(row, salt, base):
    h = np.uint64(0)
    for j in range(_width(row)):
        h = h * base + _scramble(_token(row, j), salt)
    return _finish(h, salt)


@njit(cache=True, inline="always")
def _home(fp, slots):
    """An entry's home slot: its fingerprint's top 32 bits scaled to `slots` (monotone in
    `fp`, which `_word_run` relies on)."""
    return np.int64(((fp >> _S32) * np.uint64(slots)) >> _S32)


@njit(cache=True, inline="always")
def _stored(table, s):
    """Slot s's content id + 1; 0: empty."""
    return np.int64(table[3 * s + 2])


@njit(cache=True, inline="always")
def _fp_at(table, s):
    return np.uint64(table[3 * s]) | (np.uint64(table[3 * s + 1]) << _S32)


@njit(cache=True, inline="always")
def _set_slot(table, s, fp, stored):
    table[3 * s] = np.uint32(fp & _LOW32)
    table[3 * s + 1] = np.uint32(fp >> _S32)
    table[3 * s + 2] = np.uint32(stored)


@njit(cache=True, inline="always")
def _next(s, slots):
    s += 1
    return 0 if s == slots else s


@njit(cache=True, inline="always")
def _filter_bits(fp):
    """The three bits of `fp` in its filter word, from its low bits (the word is chosen
    by its top bits, so the two are independent)."""
    return ((_ONE << (fp & _LOW6)) | (_ONE << ((fp >> _SIX) & _LOW6))
            | (_ONE << ((fp >> _TWELVE) & _LOW6)))


@njit(cache=True, inline="always")
def _filter_test(filter_words, filter_shift, fp):
    bits = _filter_bits(fp)
    return (filter_words[fp >> filter_shift] & bits) == bits


@njit(cache=True, inline="always")
def _same_tokens(query, start, stored):
    for j in range(_width(stored)):
        if query[start + j] != _token(stored, j):
            return False
    return True


@njit(cache=True, inline="always")
def _same_windows(query, start, verified, width):
    """Whether the window at `start` equals the one at `verified`, already compared with
    its stored content: a repeat is checked against the query itself, in cache, instead of
    against a stored row."""
    for j in range(width):
        if query[start + j] != query[verified + j]:
            return False
    return True


@njit(cache=True, inline="always")
def _filter_passes(query, stride, salt, base, base_pow, width, filter_words, filter_shift,
                   scratch, found):
    """Pass 1 of `probe`: the fingerprint of every window of `width` tokens starting at a
    multiple of `stride`, into ``scratch[n:]`` after the n scrambled tokens, its filter
    word prefetched as soon as it is made (the loads, all in flight at once, overlap the
    rolling arithmetic; a test right away would wait for each), then the filter test.
    The windows that pass go to ``found[2]`` (position) and ``found[3]`` (fingerprint);
    returns how many passed."""
    n = query.shape[0]
    for i in range(n):
        scratch[i] = _scramble(query[i], salt)
    last = n - width
    h = np.uint64(0)
    for j in range(width):
        h = h * base + scratch[j]
    next_probe, k = 0, n  # a counter, not p % stride: division would dominate the loop
    for p in range(last + 1):
        if p == next_probe:
            fp = _finish(h, salt)
            scratch[k] = fp
            k += 1
            _prefetch(filter_words, fp >> filter_shift)
            next_probe += stride
        if p < last:
            # h*B - s[p]*B**C + s[p+C]: only one multiply-add depends on the previous h.
            h = h * base + (scratch[p + width] - scratch[p] * base_pow)
    passes = 0
    for i in range(k - n):
        fp = scratch[n + i]
        if _filter_test(filter_words, filter_shift, fp):
            found[2, passes] = i * stride
            found[3, passes] = np.int64(fp)
            passes += 1
    return passes


@njit(cache=True, inline="always")
def _probe_into(query, stride, salt, base, base_pow, filter_words, filter_shift, table,
                blocks, width, ns_mask, ns_bit, groups, scratch, found):
    if query.shape[0] < width:
        return 0, 0, content_groups.begin(groups, 0)
    passes = _filter_passes(query, stride, salt, base, base_pow, width, filter_words,
                            filter_shift, scratch, found)
    n = query.shape[0]
    slots = table.shape[0] // 3
    for i in range(passes):  # their home slots, all in flight at once
        _prefetch(table, 3 * _home(np.uint64(found[3, i]), slots))
    # Pass 2, for the windows that passed: the table and the namespace pre-test give each
    # its candidate content, written back over found[2:4] (one at most per window read),
    # whose row is prefetched: the rows arrive together instead of one after another.
    candidates = 0
    for i in range(passes):
        p = found[2, i]
        fp = np.uint64(found[3, i])
        cid = -1
        s = _home(fp, slots)
        while _stored(table, s) != 0:
            if _fp_at(table, s) == fp and (ns_mask[_stored(table, s) - 1] & ns_bit):
                # Several contents with this fingerprint (a collision): -2 says pass 3
                # must find the one holding the window.
                cid = _stored(table, s) - 1 if cid == -1 else -2
            s = _next(s, slots)
        if cid != -1:
            found[2, candidates] = p
            found[3, candidates] = cid
            candidates += 1
            if cid >= 0:
                _prefetch_row(_row(blocks, cid))
    # Pass 3, in position order: a content's first candidate is compared token by token
    # and, once one is verified, numbered in `groups`; later ones are kept unverified as
    # repeats. Each candidate yields one entry at most, so neither list outgrows the
    # windows.
    bits = content_groups.begin(groups, candidates)
    firsts = repeats = 0
    for i in range(candidates):
        p, cid = found[2, i], found[3, i]
        verified = False
        if cid == -2:  # the one content that can hold the window, if it is one of those
            cid = _find(query, p, scratch[n + p // stride], blocks, table)
            if cid == -1 or (ns_mask[cid] & ns_bit) == 0:
                continue
            verified = True
        if content_groups.group_of(groups, bits, cid) >= 0:
            found[2, repeats] = p
            found[3, repeats] = cid
            repeats += 1
        elif verified or _same_tokens(query, p, _row(blocks, cid)):
            content_groups.add(groups, bits, cid, firsts)
            found[0, firsts] = p
            found[1, firsts] = cid
            firsts += 1
    return firsts, repeats, bits


@njit(cache=True, nogil=True)
def probe(query, stride, salt, base, base_pow, filter_words, filter_shift, table, blocks,
          width, ns_mask, ns_bit, groups, scratch, found):
    """Where stored contents occur in `query`: first occurrences verified, repeats not yet.

    Windows start at multiples of `stride`. A candidate must pass the filter, have its
    fingerprint in the table and carry `ns_bit` in its namespace mask (a cheap
    over-approximation of "claimed by the requester"). The first candidate of a content
    is compared token by token; once one is verified, `groups` numbers it
    (`local_matcher.content_groups`: group i is the i-th first occurrence) and its later
    candidates are kept unverified as repeats (`match_occupants` compares only
    as many as the content has occupants to offer). A window whose fingerprint several
    candidates share is resolved at once to the one content holding it, if any: each
    window yields one entry at most. Writes, ascending by position, the
    first occurrences' positions and ids to ``found[0]``, ``found[1]`` and the repeats'
    to ``found[2]``, ``found[3]`` (each row at least as long as the number of probes;
    `scratch` at least the query plus that, `groups` a `content_groups.buffer_for` them);
    returns (firsts, repeats).
    """
    firsts, repeats, _ = _probe_into(query, stride, salt, base, base_pow, filter_words,
                                     filter_shift, table, blocks, width, ns_mask, ns_bit,
                                     groups, scratch, found)
    return firsts, repeats


@njit(cache=True, inline="always")
def _take_into(query, found, firsts, repeats, groups, bits, cursors, next_slot, slot_offset,
               blocks, out):
    i = j = k = 0
    while i < firsts or j < repeats:
        if j == repeats or (i < firsts and found[0, i] < found[2, j]):
            slot = cursors[0, i]  # group i: the i-th first occurrence
            if slot != -1:
                out[0, k] = found[0, i]
                out[1, k] = slot
                out[2, k] = slot_offset[slot]
                k += 1
            i += 1
        else:
            cid = found[3, j]
            g = content_groups.group_of(groups, bits, cid)
            current = cursors[0, g]
            if current != -1:
                slot = next_slot[current]
                if slot != cursors[1, g] and _same_windows(query, found[2, j], found[0, g],
                                                           _width(_row(blocks, cid))):
                    cursors[0, g] = slot
                    out[0, k] = found[2, j]
                    out[1, k] = slot
                    out[2, k] = slot_offset[slot]
                    k += 1
            j += 1
    return k


@njit(cache=True, nogil=True)
def match_occupants(query, stride, salt, base, base_pow, filter_words, filter_shift, table,
                    blocks, width, ns_mask, ns_bit, groups, scratch, found,
                    head, slot_ns, ns_id, other_keys, other_slots, other_shift, next_slot,
                    slot_offset, cursors, out):
    """`probe`, the heads of the requester's lists, then the occupants, in one call.

    The head of namespace `ns_id`'s list on a content is ``head[cid]`` when that slot is
    its (``slot_ns``), else the one the caller's `HeadTable` (`other_keys`,
    `other_slots`, `other_shift`) holds under ``ns_id << 32 | cid``, if any.

    Occupants: first occurrences and repeat candidates are merged in position order. A
    first occurrence takes the head of the requester's circular list on its content
    (-1: none). A repeat candidate is compared token by token (with its content's first
    occurrence, verified) only while that list has a slot left (the next slot is not back
    at the head); if equal it takes that slot.
    Writes positions, slots and the slots' `slot_offset` to ``out[0]``, ``out[1]``,
    ``out[2]``, ascending. Returns (firsts, repeats, matches)."""
    firsts, repeats, bits = _probe_into(query, stride, salt, base, base_pow, filter_words,
                                        filter_shift, table, blocks, width, ns_mask, ns_bit,
                                        groups, scratch, found)
    for i in range(firsts):  # the contents' entries, one miss each: all in flight at once
        _prefetch(head, found[1, i])
    for i in range(firsts):  # per group: the list's cursor and its head (where it ends)
        cid = found[1, i]
        slot = head[cid]
        if slot == -1 or slot_ns[slot] != ns_id:
            slot = other_head(other_keys, other_slots, other_shift,
                              (np.int64(ns_id) << 32) | cid)
        cursors[0, i] = slot
        cursors[1, i] = slot
    return firsts, repeats, _take_into(query, found, firsts, repeats, groups, bits, cursors,
                                       next_slot, slot_offset, blocks, out)


@njit(cache=True, inline="always")
def _find(tokens, start, fp, blocks, table):
    """The id of the stored content equal to the window of `tokens` at `start` (whose
    fingerprint is `fp`), or -1."""
    slots = table.shape[0] // 3
    s = _home(fp, slots)
    while _stored(table, s) != 0:
        cid = _stored(table, s) - 1
        if _fp_at(table, s) == fp and _same_tokens(tokens, start, _row(blocks, cid)):
            return cid
        s = _next(s, slots)
    return -1


@njit(cache=True, inline="always")
def _place(fp, cid, table, filter_words, filter_shift):
    slots = table.shape[0] // 3
    s = _home(fp, slots)
    while _stored(table, s) != 0:
        s = _next(s, slots)
    _set_slot(table, s, fp, cid + 1)
    filter_words[fp >> filter_shift] |= _filter_bits(fp)


@njit(cache=True)
def insert_rows(rows, start, cids, fresh, salt, base, blocks, table, filter_words,
                filter_shift, free_ids, id_counts):
    """Find-or-insert rows from `start` on, writing each one's content id to `cids` and
    1 to `fresh` where newly stored, until one more content would make the table more than
    half full; returns the index of the first row not done (``len(rows)``: all).

    The caller guarantees blocks for ``len(rows) - start`` more contents. Stopping at the
    table's limit instead of sizing it for a whole batch up front makes the table's size
    a function of the contents stored, however they were batched.
    """
    n = rows.shape[0]
    limit = (table.shape[0] // 3) // 2
    for i in range(start, n):
        fp = _fingerprint(rows[i], salt, base)
        cid = _find(rows[i], 0, fp, blocks, table)
        if cid == -1:
            if id_counts[1] - id_counts[0] >= limit:
                return i
            if id_counts[0] > 0:  # a removed content's id first
                id_counts[0] -= 1
                cid = np.int64(free_ids[id_counts[0]])
            else:
                cid = id_counts[1]
                id_counts[1] += 1
            _put_row(_row(blocks, cid), rows[i])
            _place(fp, cid, table, filter_words, filter_shift)
            fresh[i] = 1
        cids[i] = cid
    return n


@njit(cache=True, inline="always")
def _word_run(word, filter_words, filter_shift, slots):
    """(first, count): the run of slots holding the homes of filter word `word`'s
    entries, from the home of the word's least fingerprint to that of the next word's
    (inclusive: a slot may be home to both words' entries)."""
    w = np.int64(word)
    first = _home(np.uint64(w) << filter_shift, slots)
    if w + 1 == filter_words.shape[0]:
        return first, slots - first
    return first, _home(np.uint64(w + 1) << filter_shift, slots) - first + 1


@njit(cache=True, inline="always")
def _refill_filter_word(word, table, filter_words, filter_shift):
    """Set filter word `word` from the live entries that map to it. Their home slots are
    the word's run (`_word_run`), so each sits in that run or in the cluster running on
    from its end."""
    slots = table.shape[0] // 3
    s, run = _word_run(word, filter_words, filter_shift, slots)
    bits = np.uint64(0)
    i = 0
    while i < run or _stored(table, s) != 0:
        fp = _fp_at(table, s)
        if _stored(table, s) != 0 and (fp >> filter_shift) == word:
            bits |= _filter_bits(fp)
        s = _next(s, slots)
        i += 1
    filter_words[word] = bits


@njit(cache=True)
def remove_contents(cids, salt, base, blocks, table, filter_words, filter_shift, free_ids,
                    id_counts):
    """Drop stored contents by id and put their ids on the free stack (room for them all:
    the caller's)."""
    slots = table.shape[0] // 3
    for k in range(cids.shape[0]):
        cid = cids[k]
        fp = _fingerprint(_row(blocks, cid), salt, base)
        s = _home(fp, slots)
        stored = np.int64(cid + 1)
        while _stored(table, s) != stored:
            if _stored(table, s) == 0:  # not stored: nothing to do
                s = -1
                break
            s = _next(s, slots)
        if s == -1:
            continue
        # Backward-shift deletion keeps every entry reachable from its home slot.
        hole = s
        j = s
        while True:
            j = _next(j, slots)
            if _stored(table, j) == 0:
                break
            want = _home(_fp_at(table, j), slots)
            if hole <= j:
                stays = hole < want <= j
            else:
                stays = hole < want or want <= j
            if not stays:
                _set_slot(table, hole, _fp_at(table, j), _stored(table, j))
                hole = j
        _set_slot(table, hole, np.uint64(0), 0)
        _refill_filter_word(fp >> filter_shift, table, filter_words, filter_shift)
        free_ids[id_counts[0]] = cid
        id_counts[0] += 1


@njit(cache=True)
def rebuild_table(old_table, table, filter_words, filter_shift):
    """Re-place every live entry of an old table into fresh (zeroed) arrays."""
    for s in range(old_table.shape[0] // 3):
        if _stored(old_table, s) != 0:
            _place(_fp_at(old_table, s), _stored(old_table, s) - 1, table, filter_words,
                   filter_shift)
