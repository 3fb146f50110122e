"""A small OpenAI-style router that sends each request where its KV already is.

`python -m blend_router --coordinator-url URL` (docs/OPERATIONS.md, "Routing requests"): takes
`/v1/completions` and `/v1/chat/completions`, asks the coordinator's
`POST /directory/blend-score` within a budget what each instance would reuse of the
request, predicts where its first token would come soonest from that and the work queued
at each (`policy`), forwards the request to the chosen instance's engine and streams the
answer back. When the coordinator is slow, down, or has
nothing to say (nobody holds any of the request), it picks the instance with the least
work queued through this router.

Modules, one job each: `config` (RouterConfig), `prompts` (what of a body is scored),
`tokenizer` (text and chats to ids: the model's tokenizer file, the engine's /tokenize),
`coordinator` (registry and score calls), `fleet` (instances and the work in flight at
each), `policy` (`choose_instance`: predicted service and wait, in seconds), `forward` (to the instance
and back), `app` (the HTTP application).

A client of the coordinator: it imports the wire contract (`blend_wire`), never the
coordinator's package nor the plugin (tests/test_layering.py).
"""

from blend_router.app import create_router
from blend_router.config import RouterConfig
from blend_router.tokenizer import ModelTokenizer

__all__ = ["ModelTokenizer", "RouterConfig", "create_router"]
