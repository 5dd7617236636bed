"""Compose ``conf/`` (Hydra's compose API) from command-line overrides, with short errors.

``compose(["mesh=dp2_tp2", "parallel=zero3", "train.precision=bf16"])`` returns the plain nested
dict the library's ``run_config`` takes. What Hydra would reject — a preset that does not exist, a
key that does not exist, a malformed override — becomes a ``ConfigError`` that names the config key
and the fix, raised before any process starts.
"""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Any

from ..frontend.config.run_config import ConfigError

GROUPS = ("mesh", "parallel", "model", "train", "data", "lora", "quant")


def conf_dir() -> Path:
    """``$SHARDLIB_CONF``, else the ``conf/`` beside the package (a checkout), else ``./conf``."""
    env = os.environ.get("SHARDLIB_CONF")
    for cand in ([Path(env)] if env else []) + [Path(__file__).resolve().parents[2] / "conf", Path.cwd() / "conf"]:
        if (cand / "config.yaml").is_file():
            return cand
    raise ConfigError("config: no conf/config.yaml found — expected the repository's conf/ folder. Run from the "
                      "checkout, or set SHARDLIB_CONF=<path to conf>.")


def presets(group: str, root: Path | None = None) -> list[str]:
    """The preset names of a group (its YAML files)."""
    folder = (root or conf_dir()) / group
    return sorted(p.stem for p in folder.glob("*.yaml") if not p.stem.startswith("_")) if folder.is_dir() else []


def _split(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(Hydra's own arguments, config overrides): ``hydra.*`` keys and flags are Hydra's."""
    own = [o for o in overrides if o.startswith("-") or o.lstrip("+~").startswith("hydra.")
           or o.lstrip("+~").startswith("hydra/")]
    return own, [o for o in overrides if o not in own]


def whole_axes(overrides: list[str]) -> list[str]:
    """``mesh.axes={data:1,pipe:8,tensor:8}`` replaces the preset's axes whole, in the given order
    (Hydra alone refuses a new key in it, and ``++`` would merge the two): it becomes ``~mesh.axes``
    then ``+mesh.axes=...``."""
    out = []
    for o in overrides:
        if o.startswith("mesh.axes="):
            out += ["~mesh.axes", "+" + o]
        else:
            out.append(o)
    return out


_COMPOSED: dict[tuple, dict[str, Any]] = {}     # (overrides, conf/ as it is) -> the config


def _signature(root: Path) -> tuple:
    """What ``conf/`` holds now: every YAML file's path, size and modification time."""
    out = []
    for p in sorted(root.rglob("*.yaml")):
        st = p.stat()
        out.append((str(p.relative_to(root)), st.st_size, st.st_mtime_ns))
    return tuple(out)


def check_overrides(overrides: list[str], root: Path | None = None) -> dict[str, Any]:
    """Compose with ``overrides``; return the plain config (groups only) or raise a ``ConfigError``
    naming every bad override: an unknown preset (with the presets there are), an unknown key
    (with the nearest one), a malformed ``key=value``. A composition is remembered for this process
    while ``conf/``'s files are unchanged (Hydra takes ~0.4 CPU-s a compose, and the auto-planner and the
    checks before a launch compose the same overrides again); each call returns its own copy."""
    root = root or conf_dir()
    key = (tuple(overrides), str(root), _signature(root))
    if key not in _COMPOSED:
        if len(_COMPOSED) >= 256:
            _COMPOSED.clear()
        _COMPOSED[key] = _compose(overrides, root)
    return copy.deepcopy(_COMPOSED[key])


def _compose(overrides: list[str], root: Path) -> dict[str, Any]:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    _, mine = _split(whole_axes(overrides))
    # the rules are an open table: a new logical dim is added, a mapping changed, null unmaps one
    mine = [f"++{o}" if o.startswith(("parallel.rules=", "parallel.rules.")) else o for o in mine]
    problems = []
    for o in mine:
        if o.startswith("~"):         # a deletion (whole_axes)
            continue
        if "=" not in o:
            problems.append(f"{o}: not an override — expected key=value (e.g. train.steps=50) or group=preset "
                            f"(e.g. mesh=dp2).")
            continue
        key, value = o.lstrip("+~").split("=", 1)
        if key in GROUPS and value not in presets(key, root):
            near = difflib.get_close_matches(value, presets(key, root), n=1)
            problems.append(f"{key}={value}: no such {key} preset — expected one of {', '.join(presets(key, root))}"
                            f"{f'. Did you mean {key}={near[0]}?' if near else '.'}")
    if problems:
        raise ConfigError(problems, api="config")
    picks = [o for o in mine if o.split("=", 1)[0] in GROUPS]
    with initialize_config_dir(config_dir=str(root), version_base=None):
        base = OmegaConf.to_container(compose(config_name="config", overrides=picks), resolve=False)
        for o in mine:
            key = o.lstrip("+~").split("=", 1)[0]
            if key in GROUPS or o.startswith(("+", "~")):      # a group pick, an addition, a deletion
                continue
            *path, last = key.split(".")
            node, where = base, []
            for part in path:
                if not isinstance(node, dict) or part not in node:
                    break
                node, where = node[part], where + [part]
            if len(where) != len(path) or not isinstance(node, dict) or last not in node:
                known = sorted(node) if isinstance(node, dict) else []
                near = difflib.get_close_matches(last if len(where) == len(path) else path[len(where)], known, n=1)
                hint = f" Did you mean {'.'.join(where + [near[0]])}?" if near else ""
                problems.append(f"{key}: no such config key — {'.'.join(where) or 'the config'} has "
                                f"{', '.join(known) or 'no keys'}.{hint}")
        if problems:
            raise ConfigError(problems, api="config")
        try:
            cfg = compose(config_name="config", overrides=mine)
            out = OmegaConf.to_container(cfg, resolve=True)
        except Exception as e:        # a value Hydra/OmegaConf cannot read (bad syntax, ???)
            raise ConfigError(f"config: {_short(e)}", api="config") from None
    out.pop("hydra", None)
    return _missing_to_none(out)


def _missing_to_none(node: Any) -> Any:
    """OmegaConf's ``???`` (a value the preset leaves to the command line) as None: the library's
    checks then name the key (``data.path: ... expected ...``)."""
    if isinstance(node, dict):
        return {k: _missing_to_none(v) for k, v in node.items()}
    return None if node == "???" else node


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    msg = " ".join(t.strip() for t in text if t.strip())
    return msg[:500]
