"""``python -m shardlib.calibrate``: measure this machine's figures per rank count (``shardlib/cli/calibrate.py``)."""

if __name__ == "__main__":
    import sys

    from shardlib.cli.calibrate import main
    sys.exit(main())
