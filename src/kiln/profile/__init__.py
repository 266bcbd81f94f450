"""Measurement: device ceilings, the benchmark harness (timing, provenance, result files)."""
