"""``python -m shardlib.explain``: dry-run planning at any scale (``shardlib/cli/explain.py``)."""

if __name__ == "__main__":
    import sys

    from shardlib.cli.explain import main
    sys.exit(main())
