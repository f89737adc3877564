"""Data-parallel engine replicas on Ray, routed by prefix affinity (docs/architecture.md,
"Past one GPU and one machine"). Only ray_replicas.py imports Ray (the optional `ray` extra)."""
