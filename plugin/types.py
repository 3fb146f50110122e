"""Value types of the plugin's public API.

- `LookupKey`: what the serving engine hands the plugin for one request (or one stored range):
  the request id, the whole token sequence and the namespace fields.
- `CBUnifiedLookupResult`: what a unified lookup returns: how many leading tokens the prefix
  cache covers, and the reusable non-prefix segments, ascending by `cur_st`, non-overlapping,
  each starting at or after the prefix coverage.
- `BlendMatch`, `CBMatchResult` come from `local_matcher.types` and `BlendNamespace` from
  `blend_wire`; they are re-exported here, never redefined.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from local_matcher.types import UNKNOWN_TOKEN_OFFSET, BlendMatch, CBMatchResult
from blend_wire import BlendNamespace

__all__ = ["LookupKey", "CBUnifiedLookupResult", "BlendMatch", "CBMatchResult",
           "BlendNamespace", "UNKNOWN_TOKEN_OFFSET"]


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
