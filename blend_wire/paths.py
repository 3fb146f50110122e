"""The coordinator's HTTP paths (docs/WIRE.md)."""

BLEND_LOOKUP_PATH = "/directory/blend-lookup"
BLEND_SCORE_PATH = "/directory/blend-score"
EVENTS_PATH = "/events"
STATS_PATH = "/directory/stats"
HEALTH_PATH = "/healthz"
DIRECTORY_LOOKUP_PATH = "/directory/lookup"
DIRECTORY_KEYS_PATH = "/directory/keys"
INSTANCES_PATH = "/instances"
METRICS_PATH = "/metrics"
CHUNK_SIZE_PATH = "/config/chunk-size"  # LMCache 0.5.7
