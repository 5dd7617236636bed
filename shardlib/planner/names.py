"""Names for messages: a table pattern that matches nothing is named with the parameters it most likely meant."""

from __future__ import annotations

import difflib

from torch import nn


def relative_names(model: nn.Module, prefixes: list[str]) -> list[str]:
    """Parameter and module names relative to each module in ``prefixes`` (a table's owners)."""
    out: dict[str, None] = {}
    for name, _ in [*model.named_parameters(remove_duplicate=False), *model.named_modules()]:
        for prefix in prefixes:
            if not prefix:
                out[name] = None
            elif name.startswith(prefix + "."):
                out[name[len(prefix) + 1:]] = None
    return [n for n in out if n]


def closest(pattern: str, names: list[str]) -> str:
    """The names most like ``pattern`` (a typo's likely intent), for messages: a wildcard pattern is
    compared with the names' last components (``'*.q_prj.weight'`` with ``'q_proj.weight'``)."""
    wild = any(c in pattern for c in "*?[")
    plain = pattern.lstrip("*.") if wild else pattern
    k = plain.count(".") + 1
    tails: dict[str, str] = {}
    for n in names:
        tails.setdefault(".".join(n.split(".")[-k:]) if wild else n, n)
    near = difflib.get_close_matches(plain, list(tails), n=3, cutoff=0.5)
    if near:
        return "the closest names are " + ", ".join(
            f"'*.{t}' (e.g. {tails[t]!r})" if wild and t != tails[t] else repr(t) for t in near)
    return f"names there look like {', '.join(repr(n) for n in names[:3])}" if names else "it holds no parameters"
