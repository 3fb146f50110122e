"""Value types of the plugin: its public API and the states its parts hand each other.

- `LookupKey`: what the serving engine hands the plugin for one request (or one stored range):
  the request id, the whole token sequence and the namespace fields. It is the plugin's
  edge: `BlendPlugin` validates and converts it once (`tokens_of`), and every inner layer
  (local matcher, coordinator client, reporter) takes the converted form: a contiguous
  `uint32` token array and a `BlendNamespace`.
- `CBUnifiedLookupResult`: what a unified lookup returns: how many leading tokens the prefix
  cache covers, and the reusable non-prefix segments, ascending by `cur_st`, non-overlapping,
  each starting at or after the prefix coverage.
- `FoundColumns` (`local_matcher.selection.LegColumns`) is the one result shape of both
  legs (the candidates form as columns): per content found, every position it occurs at
  and the chunks (hash, stored offset) that could serve it, with where each is held
  (`Place`), in CSR arrays built where the candidates enter (the local index, the
  coordinator's reply); the selection turns them into `CBMatchResult` segments.
  `FoundContent` is the same as plain data, one per content and place (tests, LMCache's
  default reply): `plugin.lookup.columns_of` and `found_contents` convert.
  `BlendMatch`, `CBMatchResult` come from `local_matcher.types` and `BlendNamespace` from
  `blend_wire`; re-exported, never redefined.
- Every state is an Enum defined here: `Place` (where a chunk is held, cheapest first),
  `Source` (which leg found a segment), `FleetStatus` (what one lookup's coordinator leg
  came to), `MatchState` and `FleetReply` (the client's
  hand-over), `BreakerState`. The string-valued ones compare equal to their values
  (`FleetStatus.OK == "ok"`), so traces read well in logs and tests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from blend_wire import BlendNamespace
from blend_wire.tokens import as_tokens
from local_matcher.selection import LegColumns
from local_matcher.types import EMPTY_COLUMNS, UNKNOWN_TOKEN_OFFSET, BlendMatch, CBMatchResult

__all__ = ["LookupKey", "CBUnifiedLookupResult", "BlendMatch", "CBMatchResult",
           "BlendNamespace", "UNKNOWN_TOKEN_OFFSET", "Place", "FoundContent", "FoundColumns",
           "NOTHING_FOUND",
           "Source", "FleetStatus", "MatchState", "FleetReply", "BreakerState", "tokens_of"]


@dataclass(frozen=True, eq=False)
class LookupKey:
    """One request as the engine sees it. `token_ids` is the whole sequence (list or array)."""

    request_id: str
    token_ids: Sequence[int]
    model_name: str = ""
    world_size: int = 1
    cache_salt: str = ""

    @property
    def namespace(self) -> BlendNamespace:
        """Who may be offered a chunk this request stores or finds."""
        return BlendNamespace(self.model_name, self.cache_salt, self.world_size)


class CBUnifiedLookupResult(NamedTuple):
    """Prefix coverage in tokens, plus the non-prefix segments to blend in."""

    prefix_coverage_tokens: int
    non_prefix_segments: list[CBMatchResult]

    @property
    def covered_tokens(self) -> int:
        """Tokens whose KV is reused: the prefix plus every segment."""
        return self.prefix_coverage_tokens + sum(
            s.cur_ed - s.cur_st for s in self.non_prefix_segments)


# --- conversion at the edge -------------------------------------------------------------------


def tokens_of(key: LookupKey) -> np.ndarray:
    """The key's tokens as a contiguous `uint32` array (no copy when they already are one).

    Raises `ValueError` for ids that are not integers or do not fit in uint32: they could be
    neither matched nor sent, and wrapping them silently would match the wrong content.
    """
    return as_tokens(key.token_ids).ravel()


# --- states -----------------------------------------------------------------------------------


class Place(enum.IntEnum):
    """Where a candidate chunk's KV is held; the selection prefers the lower value."""

    THIS_SERVER = 0   # this server's L1 (every local-leg chunk; or the coordinator says so)
    SHARED = 1        # a shared, fleet-wide tier
    PEER = 2          # only another instance's L1, or not said (LMCache's default reply)


class FoundContent(NamedTuple):
    """One content a leg found in the query: every position it occurs at (ascending), and
    chunks holding it that are held at `place`, as `(chunk_hash, old_st)` in the order the
    leg named them. A content whose chunks are held in several places is one
    `FoundContent` per place (sharing the positions). Both legs hand these over; the
    selection (`plugin.lookup.select`) decides which positions to keep and which chunk
    serves each."""

    positions: tuple[int, ...]
    place: Place
    chunks: tuple[tuple[bytes, int], ...]


#: One leg's found contents as columns (`local_matcher.selection.LegColumns`: positions and
#: chunks in CSR, each chunk with its `Place`): what both legs hand the selection. Built
#: where the candidates enter (the local index, a coordinator's reply); `FoundContent`s
#: convert with `FoundColumns.of_groups` (tests, LMCache's default reply).
FoundColumns = LegColumns
NOTHING_FOUND = FoundColumns.of(EMPTY_COLUMNS, 0)


class Source(enum.StrEnum):
    """Which leg(s) of a unified lookup reported a segment."""

    LOCAL = "local"
    FLEET = "fleet"
    BOTH = "both"


class FleetStatus(enum.StrEnum):
    """What the coordinator leg of one lookup came to (recorded in its trace)."""

    OFF = "off"                # no client (no URL, or no event reporting)
    SHORT = "short"            # query shorter than one chunk: not asked
    NOT_ASKED = "not_asked"    # empty model name or world size < 1: the coordinator would
                               # answer 422, so it is not asked
    DECLINED = "declined"      # the client declined (breaker open, or too many tracked)
    PENDING = "pending"
    OK = "ok"
    FAILED = "failed"          # the round-trip failed or was skipped: local-only
    TIMEOUT = "timeout"        # the lookup's deadline passed first: local-only
    LOST = "lost"              # the client no longer tracked the query (expired)


class MatchState(enum.Enum):
    """Where one coordinator query stands, as `BlendCoordinatorClient.take` reports it."""

    PENDING = "pending"    # queued or in flight; ask again
    DONE = "done"          # answered; `found` is the coordinator's (possibly nothing)
    FAILED = "failed"      # the round-trip failed or was skipped; no matches
    UNKNOWN = "unknown"    # never submitted, already taken, cancelled or expired


@dataclass(frozen=True, slots=True)
class FleetReply:
    """One hand-over from the coordinator client. Always truthy; read `state`."""

    state: MatchState
    found: FoundColumns = field(default_factory=lambda: NOTHING_FOUND)



class BreakerState(enum.StrEnum):
    """The coordinator client's circuit breaker."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"
