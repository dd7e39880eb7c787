"""Router plugins shipped with redis-router, importable as ``redis_router.plugins.<name>``.

Their source lives in the repository's top-level ``plugins/`` directory (classes beside their
YAML configs and Lua scripts). A wheel copies that directory here; in a source or editable
checkout this package's search path is extended to it instead, so the same import works in
both. Only a directory beside the checkout's ``pyproject.toml`` is added, never an arbitrary
``plugins/`` next to an installed package.
"""

from __future__ import annotations

from pathlib import Path

_root = Path(__file__).resolve().parents[2]
_source = _root / "plugins"
if _source.is_dir() and (_root / "pyproject.toml").is_file() and str(_source) not in __path__:
    __path__.append(str(_source))
