"""``Engine`` is assembled from mixins that share one namespace (``Plan`` is a plain value: its analyses are
functions beside it, ``test_plan_is_a_plain_value``). Each mixin names what it
reads from its host: every ``self.<name>`` its methods read that it does not define itself (a method,
property, class attribute, or an attribute it assigns) is declared at the top of the class as an
annotation without a value, and the host provides each of them. Checked on the sources, so a new
undeclared dependency fails here, naming the mixin and the attribute."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest

from shardlib.planner.plan import Plan
from shardlib.runtime.engine import Engine

FIX = "declare it as an annotation at the top of the class"
# mixins whose file is edited elsewhere and declares no inputs yet: their reads are checked to be
# provided by the host; once such a mixin declares any input, it gets the exact check like the rest
PENDING = {"EngineSetup"}


@dataclasses.dataclass
class _Source:
    defined: set[str]       # methods, properties, class attributes with a value, attributes it assigns
    declared: set[str]      # annotations without a value
    reads: set[str]         # self.<name> read anywhere in its methods (nested functions included)
    docstring: str


def _source(cls: type) -> _Source:
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef) and node.name == cls.__name__
    defined: set[str] = set()
    declared: set[str] = set()
    reads: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            defined |= {n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            (defined if stmt.value is not None else declared).add(stmt.target.id)
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            (reads if isinstance(n.ctx, ast.Load) else defined).add(n.attr)
    return _Source(defined, declared, reads, ast.get_docstring(node) or "")


def _provided(host: type) -> set[str]:
    """What ``host`` gives its mixins: what it or any class it is built from defines (its own
    annotations too when it is a dataclass: they are its fields)."""
    out: set[str] = set()
    for cls in host.__mro__:
        if cls is object or not cls.__module__.startswith("shardlib."):
            continue
        src = _source(cls)
        out |= src.defined
        if cls is host and dataclasses.is_dataclass(host):
            out |= {f.name for f in dataclasses.fields(host)}
    return out


MIXINS = [(host, mixin) for host in (Engine,) for mixin in host.__bases__]


@pytest.mark.parametrize("host, mixin", MIXINS, ids=[m.__name__ for _, m in MIXINS])
def test_mixin_declares_its_inputs(host, mixin):
    src = _source(mixin)
    needed = src.reads - src.defined
    name = mixin.__name__
    if name in PENDING and not src.declared:
        missing = sorted(needed - _provided(host))
        assert missing == [], (f"{name} reads {missing} from self, which {host.__name__} does not provide: "
                               f"define them in {host.__name__}, or {FIX} (and provide it)")
        return
    undeclared = sorted(needed - src.declared)
    assert undeclared == [], "\n".join(
        f"{name} reads self.{a}, which it does not define: {FIX} {name} ({a}: <type>)" for a in undeclared)
    unused = sorted(src.declared - needed)
    assert unused == [], f"{name} declares {unused} as inputs but never reads them from self: drop the annotations"
    both = sorted(src.declared & src.defined)
    assert both == [], f"{name} declares {both} as inputs but also defines them: drop the annotations"
    assert "Inputs from the host:" in src.docstring, (
        f"{name}'s docstring should say in a sentence what it takes from the host: 'Inputs from the host: ...'")


@pytest.mark.parametrize("host, mixin", MIXINS, ids=[m.__name__ for _, m in MIXINS])
def test_declared_inputs_are_provided(host, mixin):
    missing = sorted(_source(mixin).declared - _provided(host))
    assert missing == [], (f"{mixin.__name__} declares {missing} as inputs from {host.__name__}, which does not "
                           f"provide them: define them in {host.__name__} (or another of its mixins)")


def test_declarations_make_no_class_attributes():
    """An annotation without a value adds nothing to the class: the host's own definitions (a
    dataclass field, a property, a method) are what an instance reads."""
    for _, mixin in MIXINS:
        for a in _source(mixin).declared:
            assert a not in vars(mixin), f"{mixin.__name__}.{a} is declared as an input but also set on the class"
    assert [f.name for f in dataclasses.fields(Plan)] == list(Plan.__annotations__)


def test_plan_is_a_plain_value():
    """``Plan`` is built from no mixin; a rank's local plan is a ``LocalPlan``, its shapes the rank's shards."""
    from shardlib.planner.plan import LocalPlan
    assert Plan.__bases__ == (object,)
    assert issubclass(LocalPlan, Plan) and LocalPlan.__bases__ == (Plan,)


def test_the_checker_sees_an_undeclared_read():
    class Mixin:
        """Inputs from the host: the plan."""

        plan: object
        _own = 1

        def f(self):
            self.made = self.plan
            return self.made, self._own, self.helper(), self.mesh.size

        def helper(self):
            def inner():
                return self.nested
            return inner

    src = _source(Mixin)
    assert src.reads - src.defined == {"plan", "mesh", "nested"}
    assert src.declared == {"plan"}
