"""What of an OpenAI-style request body the router scores: its token ids, its text, or its
chat, checked here where the body enters (a malformed one is a `BadRequest`, 422)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
_MAX_TOKEN_ID = 2**32 - 1


class BadRequest(ValueError):
    """A request the router refuses (-> 422); the message says why."""


@dataclass(frozen=True)
class Text:
    """A completion's text prompt; `add_special_tokens` as the engine takes it (default on)."""

    text: str
    add_special_tokens: bool = True


@dataclass(frozen=True)
class Chat:
    """A chat's messages as `{"role", "content"}` with text content (a list of parts joined
    by newlines, as vLLM does for a template that takes strings)."""

    messages: list[dict]
    add_generation_prompt: bool = True


def _ids(value, where: str) -> np.ndarray:
    if not all(type(v) is int and 0 <= v <= _MAX_TOKEN_ID for v in value):
        raise BadRequest(f"{where} must be token ids: integers in [0, 2^32)")
    return np.asarray(value, dtype=np.uint32)


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false")
    return value


def request_text_or_ids(path: str, body: dict) -> np.ndarray | Text | Chat | None:
    """The request's token ids, or its text or chat to tokenize, or None (nothing to score)."""
    if path == COMPLETIONS_PATH:
        return _completion(body)
    ids = body.get("prompt_token_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise BadRequest("prompt_token_ids must be a list of token ids")
        return _ids(ids, "prompt_token_ids")
    return _chat(body)


def _completion(body: dict) -> np.ndarray | Text | None:
    prompt = body.get("prompt")
    special = _flag(body, "add_special_tokens", True)
    if isinstance(prompt, str):
        return Text(prompt, special)
    if isinstance(prompt, list) and prompt:
        if all(type(v) is int for v in prompt):
            return _ids(prompt, "prompt")
        if len(prompt) == 1 and isinstance(prompt[0], list):
            return _ids(prompt[0], "prompt[0]")
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return Text(prompt[0], special)
        if isinstance(prompt[0], (int, list)):
            raise BadRequest("prompt must be token ids (integers in [0, 2^32)), text, or "
                             "one list of either")
    return None  # several prompts in one request: nothing one instance is best for


def _chat(body: dict) -> Chat | None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequest("messages must be a list of {\"role\", \"content\"} objects")
    plain = []
    for n, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{n}] must be an object with a string role")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) for part in content):
                raise BadRequest(f"messages[{n}].content must be text or a list of parts")
            content = "\n".join(part["text"] for part in content
                                if isinstance(part.get("text"), str))
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{n}].content must be text or a list of parts")
        plain.append({"role": message["role"], "content": content})
    if not any(m["content"] for m in plain):
        return None
    return Chat(plain, _flag(body, "add_generation_prompt", True))
