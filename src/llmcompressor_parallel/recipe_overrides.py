"""Set a field on every modifier of a recipe YAML before it reaches oneshot()."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["recipe_with_overrides"]


def _modifier_groups(recipe: dict) -> list[dict]:
    return [
        group
        for stage_key, stage in recipe.items()
        if stage_key.endswith("_stage") and isinstance(stage, dict)
        for group_key, group in stage.items()
        if group_key.endswith("_modifiers") and isinstance(group, dict)
    ]


def recipe_with_overrides(path: Path, **fields: Any) -> str:
    """The YAML text of `path` with `fields` set on each modifier that has them."""
    recipe = yaml.safe_load(Path(path).read_text())
    for group in _modifier_groups(recipe):
        for arguments in group.values():
            for name, value in fields.items():
                if value is not None and name in arguments:
                    arguments[name] = value
    return yaml.safe_dump(recipe, sort_keys=False)
