"""Layer 5, front ends: ``shard_map`` (per-shard code on local views) and the launcher."""
