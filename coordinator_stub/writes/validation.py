"""An `/events` body, validated where it enters ingest: its batches found by a byte scan,
each decoded and checked against the poster's token scope, every refusal naming the field
as a whole-body decode would (`$.batches[i]...`). One rule for both write paths: one
process's fair scheduler validates a batch per step (`fair_ingest.py`), a replica the
whole body before appending it to the event log (`replicated.py`).
"""

from __future__ import annotations

import re

import msgspec

from blend_wire import CacheEventBatch, WireError, batches_of, decode, decode_batch
from coordinator_stub.errors import Forbidden
from coordinator_stub.scopes import Scope


class _Outline(msgspec.Struct):
    """A body's shape without its contents: the batches stay raw JSON until their turn."""

    batches: list[msgspec.Raw]


class _Route(msgspec.Struct):
    instance_id: object = ""


_PATH = re.compile(r"`\$")
#: The first batch's instance id, when the body opens with it (no escapes in it).
_OPENING = re.compile(rb'\s*\{\s*"batches"\s*:\s*\[\s*\{\s*"instance_id"\s*:\s*"([^"\\]*)"')


def peek_emitter(body: bytes) -> str | None:
    """The emitter named at the very start of the body, or None (scan it first)."""
    found = _OPENING.match(body, 0, 4096)
    if found is None:
        return None
    try:
        return found.group(1).decode("utf-8")
    except UnicodeDecodeError:
        return None


def emitter_of(raws: list[msgspec.Raw]) -> str:
    """The emitter whose turns a scanned body takes: its first batch's instance id. Not
    validated yet: anything that is not a string is "", and fails validation in its turn."""
    try:
        instance_id = msgspec.json.decode(raws[0], type=_Route).instance_id
    except msgspec.MsgspecError:
        return ""
    return instance_id if isinstance(instance_id, str) else ""


def outline(body: bytes) -> list[msgspec.Raw]:
    """The body's batches as raw JSON: found by a byte scan, or when the body is not
    plainly `{"batches": [...]}`, by msgspec (which refuses it, or finds them)."""
    raws = batches_of(body)
    return decode(body, _Outline).batches if raws is None else raws


def validated_batch(body: bytes, raws: list[msgspec.Raw], index: int,
                    scope: Scope | None) -> CacheEventBatch:
    """Batch `index` decoded and within `scope`, or the error that refuses the body: the
    body's own, when its JSON is broken anywhere (the scan that found the batches does
    not check it), as if it had been decoded whole first."""
    try:
        batch = decode_raw_batch(raws[index], index)
        if scope is not None:
            scope.check_batch(batch, index)
    except (WireError, Forbidden):
        decode(body, _Outline)
        raise
    return batch


def decode_raw_batch(raw: msgspec.Raw, index: int) -> CacheEventBatch:
    """Batch `index` of a body, decoded; a `WireError` names its field in the body."""
    try:
        return decode_batch(raw)
    except WireError as exc:
        # Name the field as a whole-body decode would: `$.batches[3].seq`, not `$.seq`.
        message = str(exc)
        if "`$" in message:
            message = _PATH.sub(f"`$.batches[{index}]", message)
        else:
            message = f"{message} - at `$.batches[{index}]`"
        raise WireError(message, loc=(exc.loc[0], "batches", index, *exc.loc[1:]),
                        kind=exc.kind, input=exc.input) from None


def validated_batches(body: bytes, scope: Scope | None = None
                      ) -> tuple[list[msgspec.Raw], list[CacheEventBatch]]:
    """Every batch of an `/events` body as raw JSON and decoded, each validated
    (`WireError` names the first that is not, `Forbidden` the first outside `scope`, as
    `FairIngest` would). For the event log: it forwards the raw JSON, and the replica that
    took the body applies the decoded batches."""
    raws = outline(body)
    return raws, [validated_batch(body, raws, i, scope) for i in range(len(raws))]


__all__ = ["decode_raw_batch", "emitter_of", "outline", "peek_emitter", "validated_batch",
           "validated_batches"]
