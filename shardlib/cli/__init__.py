"""Command-line edges (``python -m shardlib.explain``, ``python -m shardlib.verify``, the examples):
compose ``conf/`` with Hydra and turn it into a ``frontend.config.RunConfig``. Hydra is imported here
only, lazily, when a command runs; ``import shardlib`` never imports it."""
