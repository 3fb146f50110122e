"""Launchers for tests, demos and benchmarks: the coordinator as a child process (`process`)
and a local NATS JetStream cluster (`nats_process`). Never imported by the service
(tests/test_layering.py). docs/DESIGN.md, "Coordinator layout".
"""
