"""Error types. Every user-facing error is a ``ValueError`` or ``TypeError`` subclass.

Messages follow one form: ``<api>: <what is wrong> — got <actual>; expected <rule>. <fix>.``
When several things are wrong at once (forty parameters with a bad spec), they are
collected and raised once, a bullet per problem.
"""

from __future__ import annotations

from collections.abc import Iterable


class ShardingError(ValueError):
    """A value is wrong: a spec that does not fit a tensor or mesh, a bad mesh, a bad plan.

    ``problems`` holds one message per problem found; ``str(err)`` lists them all.
    """

    def __init__(self, problems: str | Iterable[str], *, api: str | None = None):
        if isinstance(problems, str):
            problems = [problems]
        self.problems: list[str] = list(problems)
        self.api = api
        if len(self.problems) == 1:
            msg = self.problems[0]
        else:
            head = f"{api}: {len(self.problems)} problems" if api else f"{len(self.problems)} problems"
            msg = head + ":\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(msg)


class SpecError(ShardingError):
    """A ``PartitionSpec`` or ``Layout`` does not fit its mesh or its tensor."""


class MeshError(ShardingError):
    """A mesh is malformed, or does not fit the process world it runs on."""


class ShardingTypeError(TypeError):
    """An argument has the wrong kind (a float where an axis name belongs, say)."""


class CollectiveError(ShardingError):
    """A collective was asked for something it cannot do (wrong group, mismatched shapes)."""


class Problems:
    """Collects problems and raises them once: ``with Problems(api) as p: p.add(...)``."""

    def __init__(self, api: str, error: type[ShardingError] = ShardingError):
        self.api = api
        self.error = error
        self.items: list[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self) -> None:
        if self.items:
            raise self.error(self.items, api=self.api)

    def __enter__(self) -> Problems:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.raise_if_any()
