"""Exact, complete chunk matching at any offset of a token sequence.

`ContentIndex` indexes chunks of exactly `chunk_size` tokens by content, per
namespace; `LocalMatcher` is the one-namespace view a serving process uses.
"""

from local_matcher.types import UNKNOWN_TOKEN_OFFSET, BlendMatch, CBMatchResult, ContentCandidates
from local_matcher.index import ContentIndex
from local_matcher.matcher import LocalMatcher

__all__ = [
    "UNKNOWN_TOKEN_OFFSET",
    "BlendMatch",
    "CBMatchResult",
    "ContentCandidates",
    "ContentIndex",
    "LocalMatcher",
]
