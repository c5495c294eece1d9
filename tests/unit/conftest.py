"""tests/unit's folders follow the package's. Some test modules reuse another's helpers (the scripted Gym
manager of experience/test_gym_rollouts.py, ...) by importing it by basename, which pytest's default import
mode allows only within one folder: every folder of tests/unit is put on sys.path here. Basenames are unique
across the suite (test_suite_layout.py), so an import finds one module."""

from __future__ import annotations

import sys
from pathlib import Path

for folder in sorted(p for p in Path(__file__).resolve().parent.iterdir() if p.is_dir() and p.name != "__pycache__"):
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
