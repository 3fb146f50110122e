"""What outlives a replica's process: the NATS event log (`eventlog`), the snapshot file
format (`snapshot_format`) and where snapshots are kept (`snapshot_stores`). Needs the
`cluster` extra (nats-py) except `snapshot_format`. docs/DESIGN.md, "Coordinator layout".
"""
