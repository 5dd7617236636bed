"""Reading config groups key by key: ``ConfigError`` (one message per bad key) and the checker every
group's parser uses (``config.py``, ``frontend/config/finetune.py``)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ...errors import ShardingError
from ...validate import is_int, is_number


class ConfigError(ShardingError):
    """A configuration value is wrong; ``problems`` holds one message per bad key."""


class DataError(ConfigError):
    """The dataset cannot be read: missing, unreadable, too short, or not text."""


class Checker:
    """Reads one group's mapping field by field, noting every problem by its config key."""

    def __init__(self, group: str, raw: Any, problems: list[str], known: tuple[str, ...]):
        self.group, self.problems = group, problems
        if not isinstance(raw, Mapping):
            problems.append(f"{group}: expected a mapping of keys to values — got {type(raw).__name__} {raw!r}.")
            raw = {}
        self.raw = dict(raw)
        for key in self.raw:
            if key not in known:
                near = difflib.get_close_matches(str(key), known, n=1)
                hint = f" Did you mean {group}.{near[0]}?" if near else ""
                problems.append(f"{group}.{key}: unknown key — expected one of {', '.join(known)}.{hint}")

    def bad(self, key: str, got: Any, rule: str) -> None:
        self.problems.append(f"{self.group}.{key}: got {got!r}; expected {rule}.")

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def int(self, key: str, default: Any = None, *, low: int = 1, optional: bool = False) -> Any:
        v = self.raw.get(key, default)
        if v is None and optional:
            return None
        if not is_int(v) or v < low:
            self.bad(key, v, f"an int >= {low}" + (" or null" if optional else ""))
            return default if isinstance(default, int) else low
        return v

    def number(self, key: str, default: Any = None, *, low: float = 0.0, strict: bool = False,
               optional: bool = False) -> Any:
        v = self.raw.get(key, default)
        if v is None and optional:
            return None
        if not is_number(v) or (v <= low if strict else v < low):
            self.bad(key, v, f"a number {'>' if strict else '>='} {low:g}" + (" or null" if optional else ""))
            return default
        return float(v)

    def choice(self, key: str, default: Any, options: tuple, *, optional: bool = False) -> Any:
        v = self.raw.get(key, default)
        if v is None and optional:
            return None
        if v not in options:
            self.bad(key, v, "one of " + ", ".join(map(str, options)) + (" or null" if optional else ""))
            return default
        return v

    def bool(self, key: str, default: bool) -> bool:
        v = self.raw.get(key, default)
        if not isinstance(v, bool):
            self.bad(key, v, "true or false")
            return default
        return v

    def str(self, key: str, default: Any = None, *, optional: bool = False) -> Any:
        v = self.raw.get(key, default)
        if v is None and optional:
            return None
        if not isinstance(v, str) or not v:
            self.bad(key, v, "a non-empty string" + (" or null" if optional else ""))
            return default
        return v


def field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def collapse(problems: list[str]) -> list[str]:
    """Problems that differ only in a block's index (``blocks.0``, ``blocks.1``, ...) as one, naming
    how many blocks it holds for: a rule that fails on every layer is one problem, not forty."""
    groups: dict[str, list[str]] = {}
    for p in problems:
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", p), []).append(p)
    out = []
    for key, same in groups.items():
        indices = sorted({int(i) for p in same for i in re.findall(r"\.(\d+)\.", p)})
        out.append(same[0] if len(same) == 1 else
                   f"{same[0]} (the same in {len(same)} blocks: {indices[0]}..{indices[-1]})")
    return out
