"""The choice of instance for one request, from the coordinator's scores and the fleet's load.

`choose_instance` is the router's one call into the policy (blend_router/app.py): the rest
of the router neither ranks nor balances.
"""

from __future__ import annotations

from blend_router.fleet import Fleet
from blend_wire import BlendScoreReply


def choose_instance(fleet: Fleet, scores: BlendScoreReply | None, *, unscored_reason: str,
                    request_tokens: int) -> tuple[str | None, str]:
    """`(instance, reason)`: the instance to send to (None: no instance known) and the
    `X-Route-Reason` naming why. `scores` is None when the request was not scored, for
    `unscored_reason` (`unscored`, `coordinator-unavailable`); `request_tokens` is the
    prompt's length in tokens (0 when unknown)."""
    if scores is None:
        return fleet.least_loaded(), unscored_reason
    known = [s for s in scores.instances if s.instance_id in fleet.urls]
    if not known or known[0].score <= 0:
        return fleet.least_loaded(), "nothing-cached"
    best = [s.instance_id for s in known if s.score == known[0].score]
    return fleet.least_loaded(best), "score"
