"""Files that must never be half-written: atomic writes, the checkpoint format and its pointer, run-directory locks.

Used by model/ (reading training checkpoints), train/ (writing them) and infer/; it imports nothing above it.
"""
