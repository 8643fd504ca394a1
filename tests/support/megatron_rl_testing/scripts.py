"""The repository's scripts/ (tools run by path, not a package) imported as modules, for their tests."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` as the module ``NAME``."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
