"""Recipe YAML files shipped with the package (also linked as `recipes/` at the repo root)."""

from pathlib import Path

RECIPES_DIR = Path(__file__).parent


def recipe_path(name: str) -> Path:
    """Path of a shipped recipe, by file name with or without `.yaml`."""
    path = RECIPES_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not path.is_file():
        shipped = sorted(p.name for p in RECIPES_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no shipped recipe {name!r}; shipped: {shipped}")
    return path
