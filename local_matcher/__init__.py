"""Exact, complete chunk matching at any offset of a token sequence.

`ContentIndex` (`index`) indexes chunks of exactly `chunk_size` tokens by content, per
namespace: the token windows in `store` (numba `kernels`), who claims what in `claims`.
`LocalMatcher` (`matcher`) is the view a serving process uses; `selection` is the unified
lookup's selection rule; `types` the result shapes. docs/DESIGN.md, "The content index".
"""

from local_matcher.types import UNKNOWN_TOKEN_OFFSET, BlendMatch, CBMatchResult, ContentCandidates
from local_matcher.index import ContentIndex, IndexBusy
from local_matcher.matcher import LocalMatcher

__all__ = [
    "BlendMatch",
    "CBMatchResult",
    "ContentCandidates",
    "ContentIndex",
    "IndexBusy",
    "LocalMatcher",
    "UNKNOWN_TOKEN_OFFSET",
]
