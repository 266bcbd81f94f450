"""Run presets (JSON) for `kiln run --preset NAME`."""
