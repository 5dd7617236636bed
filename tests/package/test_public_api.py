"""The public surface: every name in __all__ imports, and the contract's names exist."""

import importlib

import shardlib as sl


def test_every_public_name_imports():
    mod = importlib.import_module("shardlib")
    missing = [n for n in sl.__all__ if not hasattr(mod, n)]
    assert missing == []
    assert len(set(sl.__all__)) == len(sl.__all__)


def test_every_contract_name_is_exported_and_p_is_partitionspec():
    for name in ["AbstractMesh", "Mesh", "P", "PartitionSpec", "Layout", "psum", "all_gather", "psum_scatter",
                 "all_to_all", "ppermute", "shard_map", "use_mesh", "plan_redistribute", "redistribute",
                 "count_collectives", "to_dtensor", "from_dtensor", "launch"]:
        assert name in sl.__all__, name
    assert sl.P is sl.PartitionSpec


def test_errors_are_value_or_type_errors():
    assert issubclass(sl.ShardingError, ValueError)
    assert issubclass(sl.SpecError, ValueError)
    assert issubclass(sl.MeshError, ValueError)
    assert issubclass(sl.ShardingTypeError, TypeError)
