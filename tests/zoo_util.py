"""The model zoo's modules (tests/zoo), for tests outside it: tests/zoo is not a package, so its
folder is on sys.path only while they are imported."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ZOO = Path(__file__).resolve().parent / "zoo"


def zoo_modules(*names: str) -> list[ModuleType]:
    """import tests/zoo/<name>.py for each name ('zoo_models', 'zoo_harness'), in that order."""
    sys.path.insert(0, str(ZOO))
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(str(ZOO))
