"""Text to token ids for the score, as the served model's engine makes them.

Two sources (docs/OPERATIONS.md, "Routing requests to where their KV is"):

- `ModelTokenizer(path)` (`--tokenizer PATH`): the model's Hugging Face `tokenizer.json`
  through the `tokenizers` library; its chat template from `tokenizer_config.json`
  (`chat_template`) or `chat_template.jinja` beside it, rendered with jinja2 in a sandbox
  (`messages`, `add_generation_prompt`, the config's special tokens), then tokenized without
  adding special tokens (the template writes them), as vLLM does for chat.
- `EngineTokenizer` (`--engine-tokenize`): the engine's own `POST /tokenize` (vLLM's API:
  `{"model", "prompt", "add_special_tokens"}` or `{"model", "messages",
  "add_generation_prompt", ...}`, reply `{"tokens": [...], "count", "max_model_len"}`),
  within the score budget.

With both, the file serves what it can and the engine the rest (a chat when the file has
no template). A chat nobody can render is scored on its messages' texts each tokenized on
its own (the score matches chunks at any offset; chunks across the engine's template
markers cannot match).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import aiohttp
import numpy as np

from blend_router.prompts import ParsedRequest
from blend_wire import MAX_TOKEN_ID


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


def to_tokenize(request: ParsedRequest) -> Text | Chat | None:
    """What of a parsed request is tokenized: its text, its chat, or nothing."""
    if request.messages is not None:
        if not request.texts:
            return None
        return Chat([{"role": m.role, "content": m.content if isinstance(m.content, str)
                      else "" if m.content is None
                      else "\n".join(p.text for p in m.content if p.text is not None)}
                     for m in request.messages], request.add_generation_prompt)
    if request.texts is not None and len(request.texts) == 1:
        return Text(request.texts[0], request.add_special_tokens)
    return None


class ModelTokenizer:
    """A model's `tokenizer.json` (and chat template, when it has one)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise RuntimeError("--tokenizer needs the tokenizers library: pip install "
                               "tokenizers (the router extra)") from None
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise RuntimeError(f"--tokenizer {path}: no such file (give the model's "
                               f"tokenizer.json, or the folder holding it)")
        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own Exception subclasses
            raise RuntimeError(f"--tokenizer {file}: not a tokenizer.json the tokenizers "
                               f"library reads ({exc})") from None
        self.name = str(file)
        self._template, self._specials = _chat_template(file.parent)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return np.asarray(ids, dtype=np.uint32)

    def render(self, chat: Chat) -> str:
        """The chat as the model's template writes it (`has_chat_template` must hold)."""
        return self._template.render(
            messages=chat.messages, add_generation_prompt=chat.add_generation_prompt,
            **self._specials)

    def tokens(self, found: Text | Chat) -> np.ndarray | None:
        """The ids of a text or a chat; None for a chat the file cannot render."""
        if isinstance(found, Text):
            return self.encode(found.text, found.add_special_tokens)
        if self._template is None:
            return None
        try:
            rendered = self.render(found)
        except Exception:  # noqa: BLE001 - the template refused the chat (raise_exception)
            return None    # or broke on it: the engine would refuse it too; routed unscored
        return self.encode(rendered, add_special_tokens=False)


def _chat_template(folder: Path):
    """(compiled template or None, the special tokens the template may name)."""
    config_file = folder / "tokenizer_config.json"
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except ValueError as exc:
            raise RuntimeError(f"{config_file} is not JSON: {exc}") from None
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the "default" one
        source = next((t.get("template") for t in source
                       if isinstance(t, dict) and t.get("name") == "default"), None)
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        source = jinja_file.read_text()
    specials = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        specials[name] = value if isinstance(value, str) else ""
    if not isinstance(source, str):
        return None, specials
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise RuntimeError("the model's chat template needs jinja2: pip install jinja2 "
                           "(the router extra)") from None

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source), specials
    except TemplateError as exc:
        raise RuntimeError(f"the chat template in {folder} does not compile: {exc}") from None


@dataclass
class EngineTokenizer:
    """The engine's `POST /tokenize`. `engine_url` gives an engine's base URL (None: none
    known); `session` is the router's client session."""

    engine_url: Callable[[], str | None]
    session: Callable[[], aiohttp.ClientSession]

    async def tokens(self, found: Text | Chat, model: str) -> np.ndarray | None:
        """The engine's ids, or None when it has none to give (no engine, an error, a reply
        that is not token ids). The caller bounds the time."""
        base = self.engine_url()
        if base is None:
            return None
        if isinstance(found, Text):
            ask = {"model": model, "prompt": found.text,
                   "add_special_tokens": found.add_special_tokens}
        else:
            ask = {"model": model, "messages": found.messages,
                   "add_generation_prompt": found.add_generation_prompt}
        try:
            async with self.session().post(base + "/tokenize", json=ask) as reply:
                if reply.status != 200:
                    return None
                ids = (await reply.json()).get("tokens")
        except (aiohttp.ClientError, ValueError, AttributeError):
            return None
        if not isinstance(ids, list) or not all(
                type(v) is int and 0 <= v <= MAX_TOKEN_ID for v in ids):
            return None
        return np.asarray(ids, dtype=np.uint32)


@dataclass
class Tokenizers:
    """What the router tokenizes text with: the model's file, the engine, both or neither."""

    model: ModelTokenizer | None = None
    engine: EngineTokenizer | None = None

    async def tokens_of(self, request: ParsedRequest) -> np.ndarray | None:
        """The request's token ids to score, or None (nothing to score); tokenizing runs
        off the event loop."""
        if request.ids is not None:
            return request.ids
        found = to_tokenize(request)
        if found is None:
            return None
        ids = None
        if self.model is not None:
            ids = await _off_loop(lambda: self.model.tokens(found))
        if ids is None and self.engine is not None:
            ids = await self.engine.tokens(found, request.model)
        if ids is None and isinstance(found, Chat) and self.model is not None:
            ids = await _off_loop(lambda: _each_message(self.model, found))
        return ids


def _each_message(model: ModelTokenizer, chat: Chat) -> np.ndarray | None:
    texts = [m["content"] for m in chat.messages if m["content"]]
    if not texts:
        return None
    return np.concatenate([model.encode(t, add_special_tokens=False) for t in texts])


async def _off_loop(work: Callable[[], np.ndarray | None]) -> np.ndarray | None:
    # Tokenizing a long prompt, or rendering a template, takes milliseconds.
    return await asyncio.get_running_loop().run_in_executor(None, work)
