"""The runtime: executes a ``Plan`` on real process groups (hooks, buckets, units, scaling)."""
