"""``python -m shardlib.verify``: the parity matrix (``shardlib/cli/verify.py``); ``check_replicas(engine)``:
every replicated copy bit-equal after a step (``runtime/replicas.py``)."""

from shardlib.runtime.replicas import check_replicas as check_replicas
from shardlib.runtime.replicas import replica_mismatches as replica_mismatches

if __name__ == "__main__":
    import sys

    from shardlib.cli.verify import main
    sys.exit(main())
