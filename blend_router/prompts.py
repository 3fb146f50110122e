"""What of an OpenAI-style request body the router scores: its token ids or its texts."""

from __future__ import annotations

import numpy as np

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
_MAX_TOKEN_ID = 2**32 - 1


class BadRequest(ValueError):
    """A request the router refuses (-> 422); the message says why."""


def _ids(value, where: str) -> np.ndarray:
    if not all(type(v) is int and 0 <= v <= _MAX_TOKEN_ID for v in value):
        raise BadRequest(f"{where} must be token ids: integers in [0, 2^32)")
    return np.asarray(value, dtype=np.uint32)


def request_text_or_ids(path: str, body: dict) -> np.ndarray | list[str] | None:
    """The request's token ids, or its texts to tokenize, or None (nothing to score)."""
    if path == COMPLETIONS_PATH:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and prompt:
            if all(type(v) is int for v in prompt):
                return _ids(prompt, "prompt")
            if len(prompt) == 1 and isinstance(prompt[0], list):
                return _ids(prompt[0], "prompt[0]")
            if len(prompt) == 1 and isinstance(prompt[0], str):
                return [prompt[0]]
            if isinstance(prompt[0], (int, list)):
                raise BadRequest("prompt must be token ids (integers in [0, 2^32)), text, or "
                                 "one list of either")
        return None  # several prompts in one request: nothing one instance is best for
    ids = body.get("prompt_token_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise BadRequest("prompt_token_ids must be a list of token ids")
        return _ids(ids, "prompt_token_ids")
    texts = []
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part["text"] for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return texts or None
