"""``python -m shardlib.verify``: the parity matrix (``shardlib/cli/verify.py``)."""

if __name__ == "__main__":
    import sys

    from shardlib.cli.verify import main
    sys.exit(main())
