"""docs/grafana/coordinator.json, the coordinator's dashboard, queries only series a running
coordinator serves: a real coordinator (`coordinator_stub.launch`) is fed one event batch, a
blend lookup, a blend score and a directory lookup, then every metric name (and every label
value a selector names) of every panel's PromQL is looked for in its `/metrics`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import numpy as np

from blend_wire import (BLEND_LOOKUP_PATH, BLEND_SCORE_PATH, EVENTS_PATH, encode,
                        encode_tokens)
from coordinator_stub.launch.process import launch_coordinator

LANE = "coordinator"

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "coordinator.json"
#: The coordinator's metric families: its own, LMCache's, and prometheus_client's process ones.
_NAME = re.compile(r"\b((?:blend_coordinator|lmcache_coordinator|process|python)_[a-z0-9_]+)"
                   r"(\{[^}]*\})?")
_MATCHER = re.compile(r'(\w+)\s*=\s*"([^"]*)"')
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s")


def _exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"], "a dashboard without panels"
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert all(exprs) and len(exprs) >= len(dashboard["panels"])
    return exprs


def _served(text: str) -> tuple[set[str], set[tuple[str, str, str]]]:
    """Metric names `/metrics` serves (families from `# TYPE`, with a histogram's and a
    counter's sample names) and the `(name, label, value)` of every sample's labels."""
    names, labels = set(), set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {name + "_bucket", name + "_sum", name + "_count"}
            elif kind == "counter" and not name.endswith("_total"):
                names.add(name + "_total")
        elif line and not line.startswith("#"):
            sample = _SAMPLE.match(line)
            names.add(sample.group(1))
            for label, value in _MATCHER.findall(sample.group(2) or ""):
                labels.add((sample.group(1), label, value))
    return names, labels


def _traffic(url: str) -> str:
    """Something through every path the panels watch; then `/metrics`."""
    tokens = np.arange(1000, 1000 + 512, dtype=np.uint32)
    batch = {"instance_id": "inst-a", "incarnation": 1, "seq": 1, "event_type": "store",
             "tier": "l1", "backend": "dram", "ts": 0.0, "entries": [
                 {"key": {"chunk_hash_hex": f"{i + 1:02x}" * 8, "model_name": "m",
                          "kv_rank": 0, "cache_salt": ""},
                  "size_bytes": 1, "token_ids": tokens[i * 256:(i + 1) * 256].tolist(),
                  "token_offset": i * 256} for i in range(2)]}
    query = {"tokens_b64": encode_tokens(tokens), "model_name": "m"}
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.post(EVENTS_PATH, content=encode({"batches": [batch]})).status_code == 200
        assert http.post(BLEND_LOOKUP_PATH, content=encode(query)).status_code == 200
        assert http.post(BLEND_SCORE_PATH, content=encode(query)).status_code == 200
        assert http.post(EVENTS_PATH, content=b"{").status_code == 422  # a refusal
        metrics = http.get("/metrics")
        assert metrics.status_code == 200
    return metrics.text


def test_every_series_the_dashboard_queries_is_served():
    with launch_coordinator("--enable-blend-lookup") as coordinator:
        names, labels = _served(_traffic(coordinator.url))
    missing, unknown_labels = [], []
    for expr in _exprs():
        used = _NAME.findall(expr)
        assert used, f"no metric of the coordinator in {expr!r}"
        for name, selector in used:
            if name not in names:
                missing.append((name, expr))
            for label, value in _MATCHER.findall(selector):
                if (name, label, value) not in labels:
                    unknown_labels.append((name, label, value))
    assert not missing, f"queried but not in /metrics: {missing}"
    assert not unknown_labels, f"selectors matching no series: {unknown_labels}"
