"""The peers bench/infer.py measures kiln against, each on a copy of the same weights."""
