"""Hardware ceilings and measurement."""
