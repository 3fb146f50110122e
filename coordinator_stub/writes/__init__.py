"""The coordinator's write paths: local fair ingest (`local`) and the replicated event-log
path (`replicated`, needs the `cluster` extra). docs/DESIGN.md, "Coordinator layout".
"""
