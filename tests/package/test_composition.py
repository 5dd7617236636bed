"""The engine and the plan are composed, not mixed in: ``Engine`` and ``Plan`` derive from nothing of
shardlib's; every part of a step that touches gradients speaks one protocol (``runtime/grad_sync.py``);
and no module reads another part's private state (``engine._x``, ``self.engine.units._x``). Checked on
the sources, so a new reach names its file and line."""

from __future__ import annotations

import ast
import pathlib

import pytest

import shardlib
from shardlib.planner.plan import LocalPlan, Plan
from shardlib.runtime.buckets import GradBuckets
from shardlib.runtime.engine import Engine
from shardlib.runtime.grad_sync import GradSync
from shardlib.runtime.pipeline import PipelineRuntime
from shardlib.runtime.tensor import TensorRuntime
from shardlib.runtime.units import UnitRunner

ROOT = pathlib.Path(shardlib.__file__).parent
# names under which the engine and its parts are reached from another module
PARTS = {"engine", "eng", "units", "buckets", "tensor", "pipe", "offload", "params_offload", "act_offload",
         "access", "builder", "scaler", "reduction", "micro_batches"}


def private_reaches(source: str) -> list[tuple[int, str]]:
    """``(line, "base._name")`` for every read or write of a single-underscore attribute of a value named as
    one of the engine's parts (a name or the last attribute of a chain)."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            base = n.value.id if isinstance(n.value, ast.Name) else \
                n.value.attr if isinstance(n.value, ast.Attribute) else None
            if base in PARTS:
                out.append((n.lineno, f"{base}.{n.attr}"))
    return out


def test_engine_and_plan_are_built_from_no_mixin():
    assert Engine.__bases__ == (object,)
    assert Plan.__bases__ == (object,)
    assert LocalPlan.__bases__ == (Plan,)        # a rank's local plan: its shapes the rank's shards


def test_every_part_that_touches_gradients_speaks_the_grad_sync_protocol():
    for part in (GradBuckets, UnitRunner, TensorRuntime, PipelineRuntime):
        assert issubclass(part, GradSync), part
    # and the step calls only the protocol's moments on them: no branch names a form
    step = ast.parse(pathlib.Path(ROOT / "runtime" / "engine.py").read_text())
    phases = {f.name: f for f in ast.walk(step) if isinstance(f, ast.FunctionDef)
              and f.name in ("_step", "_forward_backward", "_step_scalars")}
    assert len(phases) == 3
    for name, fn in phases.items():
        forms = sorted({n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                        and n.attr in ("buckets", "units", "tensor", "pipe")})
        assert forms == [], f"Engine.{name} asks for {forms}: go through self.syncs / micro_batches / reduction"


def test_no_module_reads_another_parts_private_state():
    found = [f"{p.relative_to(ROOT.parent)}:{line}: {what}" for p in sorted(ROOT.rglob("*.py"))
             for line, what in private_reaches(p.read_text())]
    assert found == [], "private state read across parts (make it public on the part, or pass it in):\n" + \
        "\n".join(found)


def test_checkpoints_and_pretrained_take_the_training_state_not_the_engine():
    """``checkpoint/`` and ``pretrained/`` take a ``TrainingState`` (the states and the plan of a run): they
    import no engine and read nothing else from what they are given."""
    from shardlib.runtime.state import TrainingState
    allowed = {n for n in vars(TrainingState) if not n.startswith("_")} | set(TrainingState.__annotations__)
    folders = [ROOT / "runtime" / "checkpoint", ROOT / "runtime" / "pretrained"]
    extra = []
    for p in sorted(f for d in folders for f in d.glob("*.py")):
        src = p.read_text()
        assert "from ..engine import" not in src and "runtime.engine" not in src, p
        for n in ast.walk(ast.parse(src)):
            if isinstance(n, ast.Attribute) and (
                    isinstance(n.value, ast.Name) and n.value.id in ("training", "engine", "eng")
                    or isinstance(n.value, ast.Attribute) and n.value.attr in ("training", "engine")) \
                    and n.attr not in allowed:
                extra.append(f"{p.relative_to(ROOT.parent)}:{n.lineno}: .{n.attr}")
    assert extra == [], "read from the run but not in TrainingState:\n" + "\n".join(extra)
    # and the engine provides every name of it
    missing = [n for n in sorted(allowed) if n not in dir(Engine) and n not in _assigned(Engine)]
    assert missing == [], missing


def _assigned(cls: type) -> set[str]:
    import inspect
    import textwrap
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


@pytest.mark.parametrize("source, expected", [
    ("engine._needs_load = True", [(1, "engine._needs_load")]),
    ("x = self.engine.units._reduce(u)", [(1, "units._reduce")]),
    ("self._own = 1\nengine.needs_load\nmod._parameters\nengine.__class__", []),
])
def test_the_reach_check_sees_a_private_read_and_only_that(source, expected):
    assert private_reaches(source) == expected
