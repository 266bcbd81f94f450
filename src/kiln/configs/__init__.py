"""Run presets (JSON) for `kiln run --preset NAME`: a registry no subsystem owns.

`kiln run` resolves them into a RunConfig (train/config.py); `kiln model summary NAME` reads only their
"model" section (model/checkpoint.py), which is why they live below both.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from kiln.errors import KilnError

PRESETS = ("cpu", "gpu", "tiny", "speedrun")


def load_preset(name: str) -> dict[str, Any]:
    """The preset's JSON as a dict (unvalidated: the caller builds its own config from it)."""
    if name not in PRESETS:
        raise KilnError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return json.loads(resources.files("kiln.configs").joinpath(f"{name}.json").read_text())
