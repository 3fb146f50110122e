"""What of an OpenAI-style request body the router reads, decoded and checked once.

`parse_request(path, raw)` decodes a body into a `ParsedRequest` (model, cache salt, and
what to score: token ids, texts, or chat messages) or raises `MalformedRequest` saying why.
Only the fields the router reads are decoded, each with its type; the body itself is
forwarded as received. Large bodies are decoded in a worker process (`Parser`), so a
16 MiB prompt never holds the router's event loop (a decoder holds the GIL).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import threading
import time
from typing import Union

import msgspec
import numpy as np

from blend_wire import Unprocessable
from blend_wire.values import TokenId

log = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
#: Bodies up to this size are decoded on the event loop (well under a millisecond); larger
#: ones in the worker process.
INLINE_PARSE_BYTES = 256 * 1024


class MalformedRequest(Unprocessable):
    """A body the router cannot read as the request its path takes (422, as the coordinator
    answers a body breaking the wire contract); the message says why."""


class _Part(msgspec.Struct):
    type: str = ""
    text: Union[str, None] = None


class Message(msgspec.Struct):
    """One chat message as the router reads it (other fields are forwarded, not read)."""

    role: str = ""
    content: Union[str, list[_Part], None] = None


class _Completion(msgspec.Struct):
    model: Union[str, None] = None
    prompt: Union[str, list[Union[TokenId, str, list[TokenId]]], None] = None
    cache_salt: Union[str, None] = None
    add_special_tokens: bool = True


class _Chat(msgspec.Struct):
    messages: list[Message]
    model: Union[str, None] = None
    prompt_token_ids: Union[list[TokenId], None] = None
    cache_salt: Union[str, None] = None
    add_generation_prompt: bool = True


class ParsedRequest(msgspec.Struct):
    """What the router reads of one request: `ids` (token ids to score), else `texts` (to
    tokenize; for chat, the messages' texts in order, `messages` holding the messages),
    else nothing to score. `add_special_tokens` (completions) and `add_generation_prompt`
    (chats) as the engine takes them."""

    model: str
    cache_salt: str
    ids: Union[np.ndarray, None] = None
    texts: Union[list[str], None] = None
    messages: Union[list[Message], None] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


_SHAPES = {COMPLETIONS_PATH: _Completion, CHAT_COMPLETIONS_PATH: _Chat}
_DECODERS = {path: msgspec.json.Decoder(shape) for path, shape in _SHAPES.items()}


def parse_request(path: str, raw: bytes) -> ParsedRequest:
    """The request at `path` (a completions path) read from `raw`; `MalformedRequest` if it
    is not JSON, not an object, or a field the router reads has the wrong type."""
    try:
        body = _DECODERS[path].decode(raw)
    except msgspec.ValidationError as exc:
        raise MalformedRequest(f"the body does not fit {path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise MalformedRequest(f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise MalformedRequest("the body is nested too deeply to be a request") from None
    parsed = ParsedRequest(model=body.model or "", cache_salt=body.cache_salt or "")
    if isinstance(body, _Completion):
        parsed.add_special_tokens = body.add_special_tokens
        _completion_prompt(body.prompt, parsed)
    elif body.prompt_token_ids is not None:
        parsed.ids = np.asarray(body.prompt_token_ids, dtype=np.uint32)
    else:
        parsed.messages = body.messages
        parsed.add_generation_prompt = body.add_generation_prompt
        texts = []
        for message in body.messages:
            if isinstance(message.content, str):
                texts.append(message.content)
            elif message.content is not None:
                texts.extend(part.text for part in message.content if part.text is not None)
        parsed.texts = texts or None
    return parsed


def _completion_prompt(prompt, parsed: ParsedRequest) -> None:
    if isinstance(prompt, str):
        parsed.texts = [prompt]
    elif not prompt:
        return
    elif len(prompt) == 1 and isinstance(prompt[0], list):
        parsed.ids = np.asarray(prompt[0], dtype=np.uint32)
    elif len(prompt) == 1 and isinstance(prompt[0], str):
        parsed.texts = [prompt[0]]
    elif type(prompt[0]) is int:
        if not all(type(v) is int for v in prompt):
            raise MalformedRequest("prompt must be token ids (integers in [0, 2^32)), "
                                   "text, or one list of either")
        parsed.ids = np.asarray(prompt, dtype=np.uint32)
    elif isinstance(prompt[0], list):
        raise MalformedRequest("prompt must be token ids (integers in [0, 2^32)), text, or "
                               "one list of either")
    # several texts in one request: nothing one instance is best for


def _exit_with_parent(parent: int) -> None:
    """In the worker: exit once the router is gone (killed, it shuts nothing down)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class Parser:
    """`parse_request`, inline for small bodies and in one worker process for large ones."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def start(self) -> None:
        # spawn: the worker inherits none of the router's threads or sockets; it exits
        # when the router does, however that ends.
        self._pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"),
            initializer=_exit_with_parent, initargs=(os.getpid(),))
        self._pool.submit(int).result()  # started (and this module imported) now, not later

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def parse(self, path: str, raw: bytes) -> ParsedRequest:
        if len(raw) <= INLINE_PARSE_BYTES or self._pool is None:
            return parse_request(path, raw)
        pool = self._pool
        try:
            return await asyncio.wrap_future(pool.submit(parse_request, path, raw))
        except concurrent.futures.BrokenExecutor:
            # The worker died (killed, out of memory): a new one for the next request, and
            # this one parsed here rather than refused for the router's trouble.
            if self._pool is pool:
                log.warning("the body-parsing worker process died; starting another")
                pool.shutdown(wait=False, cancel_futures=True)
                await asyncio.get_running_loop().run_in_executor(None, self.start)
            return parse_request(path, raw)
