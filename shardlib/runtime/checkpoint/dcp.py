"""A checkpoint in DCP's standard layout: every tensor under its model name, a rank's boxes as chunks of it.

**Names** (the keys torchtitan writes: ``get_state_dict``'s model keys at the top level, the flattened
optimizer state under ``optimizer.``):

* a parameter's value (the fp32 master; a frozen one's value) under each of its model names
  (``wte.weight``; a tied parameter under every name its model gives it, as ``model.state_dict()`` does);
* a persistent buffer under its name;
* optimizer state ``optimizer.state.<name>.<key>`` (``exp_avg`` sharded like its parameter, ``step`` whole)
  and its group's hyper-parameters ``optimizer.param_groups.<name>.<key>`` (``flatten_optimizer_state_dict``'s
  form: per parameter, so the group structure does not matter);
* what only shardlib reads under ``_shardlib.``: each rank's RNG states, a quantized weight's components,
  non-persistent buffers.

A rank's piece of a global tensor is a few boxes (``checkpoint.pieces.Piece``); each box is one chunk
(offsets, sizes) of the key, written by :class:`BoxSavePlanner` without first copying it out, and
replicated boxes (the same offsets from several ranks) written once (DCP's de-duplication). So
``dcp_to_torch_save`` gives the full state dict by name, FSDP2's ``dcp.load`` reads its shards from an
engine's checkpoint, and :class:`BoxLoadPlanner` reads any DCP checkpoint's chunks that overlap a
rank's boxes straight into them (DCP's own resharding, ``create_read_items_for_chunk_list``).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_write_items, create_read_items_for_chunk_list

from ...algebra.boxes import Box

if TYPE_CHECKING:
    from ..training import TrainingState

OWN = "_shardlib."                   # what only shardlib reads
OPTIM = "optimizer."                 # torchtitan's key for the optimizer's state
FOREIGN_OPTIM = ("optimizer.", "optim.")       # what other trainers call it
FOREIGN_MODEL = ("", "model.")


# ---- names ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Names:
    """How an engine's piece keys (``param/<name>``, ``optim/<k>/<name>``, ``quant/<name>/<c>``,
    ``buffer/<name>``) are named in the checkpoint: ``aliases`` every model name of a parameter (by its
    first), ``persistent`` the buffers ``model.state_dict()`` holds."""

    aliases: dict[str, list[str]]
    persistent: frozenset[str]

    @classmethod
    def of(cls, training: TrainingState) -> Names:
        model = training.model
        first = {id(p): k for k, p in model.named_parameters()}
        aliases: dict[str, list[str]] = {}
        for k, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(first[id(p)], []).append(k)
        persistent = set()
        for mname, mod in model.named_modules(remove_duplicate=False):
            for b in mod._buffers:
                if b not in mod._non_persistent_buffers_set:
                    persistent.add(f"{mname}.{b}" if mname else b)
        return cls(aliases, frozenset(persistent))

    def saved(self, key: str) -> list[str]:
        """The names ``key`` is written under."""
        kind, _, rest = key.partition("/")
        if kind == "param":
            return self.aliases.get(rest, [rest])
        return [self.read(key)[0]]

    def read(self, key: str) -> list[str]:
        """The names ``key`` may be found under, best first (shardlib's own, then other trainers')."""
        kind, _, rest = key.partition("/")
        if kind == "param":
            names = self.aliases.get(rest, [rest])
            return [f"{p}{n}" for p in FOREIGN_MODEL for n in names]
        if kind == "optim":
            k, _, name = rest.partition("/")
            return [f"{p}state.{name}.{k}" for p in FOREIGN_OPTIM]
        if kind == "quant":
            name, _, comp = rest.rpartition("/")
            return [f"{OWN}quant.{name}.{comp}"]
        if kind == "buffer":
            return [rest, f"model.{rest}"] if rest in self.persistent else [f"{OWN}buffer.{rest}"]
        if kind == "rng":
            return [f"{OWN}rng.{rest.replace('/', '.')}"]
        raise ValueError(key)


def param_group_entries(training: TrainingState) -> dict[str, Any]:
    """``optimizer.param_groups.<name>.<key>``: each trainable parameter's group hyper-parameters
    (tensor-valued ones as numbers), as ``get_optimizer_state_dict(flatten_optimizer_state_dict=True)``
    gives them. Written by the ranks at coordinate 0 of every axis but ``pipe`` (each stage's first
    rank: every parameter once, the plans DCP gathers not ``world`` times longer)."""
    mesh, gplan = training.mesh, training.global_plan
    pipe = gplan.pipeline.axis if gplan.pipe_size > 1 else None
    if any(mesh.coord(mesh.rank, a) for a in mesh.axis_names if a != pipe):
        return {}
    by_master = {id(s.master): s.name for s in training.states if s.trainable}
    out = {}
    for g in training.optimizer.param_groups:
        for p in g["params"]:
            name = by_master.get(id(p))
            if name is None:
                continue
            for k, v in g.items():
                if k != "params":
                    out[f"{OPTIM}param_groups.{name}.{k}"] = v.item() if isinstance(v, torch.Tensor) else v
    return out


# ---- save -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Chunked:
    """One global tensor this rank writes boxes of: ``chunks`` maps a box's offsets to its sizes and a
    function giving its values."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: dict[tuple[int, ...], tuple[tuple[int, ...], Callable[[], torch.Tensor]]]


class BoxSavePlanner(DefaultSavePlanner):
    """Writes ``chunked`` (name -> :class:`Chunked`) as chunks of their names and ``whole`` (name -> a
    tensor or any picklable value) as DCP writes a state dict's entries."""

    def __init__(self, chunked: dict[str, Chunked], whole: dict[str, Any]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunked, self.whole = chunked, whole
        self._pickled: dict[tuple[str, str], bytes] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, c in self.chunked.items():
            props = TensorProperties(dtype=c.dtype)
            for offsets, (sizes, _) in c.chunks.items():
                items.append(WriteItem(
                    index=MetadataIndex(name, torch.Size(offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                properties=props, size=torch.Size(c.shape))))
        for name, obj in self.whole.items():
            items += _create_write_items(name, obj)
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]):
        plans, metadata = super().create_global_plan(all_plans)
        # what ``dcp_to_torch_save`` nests: the model's names at the top, the rest under their first part
        nest = {}
        for k in metadata.state_dict_metadata:
            head = next((p for p in (OWN, OPTIM) if k.startswith(p)), None)
            nest[k] = (k,) if head is None else (head[:-1], k[len(head):])
        self.metadata = dataclasses.replace(metadata, planner_data=nest)
        return plans, self.metadata

    def transform_object(self, write_item: WriteItem, object: Any):
        """A value written as bytes, pickled once per distinct value (every parameter of a group
        has the same ``lr``)."""
        if write_item.type != WriteItemType.BYTE_IO:
            return object
        key = (type(object).__name__, repr(object))
        if key not in self._pickled:
            self._pickled[key] = super().transform_object(write_item, object).getvalue()
        return io.BytesIO(self._pickled[key])

    def lookup_object(self, index: MetadataIndex) -> Any:
        c = self.chunked.get(index.fqn)
        if c is not None:
            return c.chunks[tuple(index.offset)][1]()
        return self.whole[index.fqn]


# ---- load -------------------------------------------------------------------------------------------

class BoxLoadPlanner(DefaultLoadPlanner):
    """Reads, for each name of ``boxes`` (name -> ``[(box, tensor view)]``), the checkpoint's chunks that
    overlap each box straight into its view, and each name of ``whole`` (name -> tensor) whole into it.
    ``covered`` counts, per (name, box offsets), the elements read."""

    def __init__(self, boxes: dict[str, list[tuple[Box, torch.Tensor]]], whole: dict[str, torch.Tensor]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes, self.whole = boxes, whole
        self.views = {(name, tuple(box[0])): t for name, bs in boxes.items() for box, t in bs}
        self.covered: dict[tuple[str, tuple[int, ...]], int] = {}

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        items = []
        for name, bs in self.boxes.items():
            chunks = [ChunkStorageMetadata(torch.Size(b[0]), torch.Size(b[1])) for b, _ in bs]
            items += create_read_items_for_chunk_list(name, md[name], chunks)
        for name, t in self.whole.items():
            items += create_read_items_for_chunk_list(name, md[name], [ChunkStorageMetadata(
                torch.Size([0] * t.dim()), t.shape)])
        for it in items:
            key = (it.dest_index.fqn, tuple(it.dest_index.offset))
            n = 1
            for x in it.lengths:
                n *= x
            self.covered[key] = self.covered.get(key, 0) + n
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        t = self.views.get((index.fqn, tuple(index.offset)))
        return self.whole[index.fqn] if t is None else t
