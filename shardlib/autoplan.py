"""``python -m shardlib.autoplan``: the fastest plans that fit (``shardlib/cli/autoplan.py``)."""

if __name__ == "__main__":
    import sys

    from shardlib.cli.autoplan import main
    sys.exit(main())
