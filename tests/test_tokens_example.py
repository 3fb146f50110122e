"""examples/tokens.example, the token file docs/OPERATIONS.md points operators at, is one the
coordinator accepts, with a grant of every role and every kind of scope."""

from __future__ import annotations

from pathlib import Path

from coordinator_stub.config import parse_args
from coordinator_stub.scopes import ADMIN, EMITTER, READER, tokens_from

LANE = "unit"

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tokens.example"


def test_the_example_token_file_parses_with_every_role_and_scope():
    grants = tokens_from(str(EXAMPLE), environ={})
    assert {role for role, _, _ in grants} == {EMITTER, READER, ADMIN}
    assert any(scope.instances for role, _, scope in grants if role == EMITTER)
    assert any(scope.salts for role, _, scope in grants if role == READER)
    assert any(scope.salts == frozenset({""}) for _, _, scope in grants)  # the empty salt
    assert all(token.startswith("REPLACE-ME-") for _, token, _ in grants)  # no usable secret
    config = parse_args(["--auth-token-file", str(EXAMPLE)], environ={})
    assert len(config.access_tokens) == len(grants)


def test_operations_md_points_at_it():
    assert "examples/tokens.example" in (ROOT / "docs" / "OPERATIONS.md").read_text()
