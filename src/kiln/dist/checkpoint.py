"""Sharded checkpoints through torch.distributed.checkpoint (DCP): each rank writes its own shards.

`save_sharded` writes the model's and optimizer's sharded state dicts (DTensors as they are: no
gather, no rank holding the whole model) into a temporary directory beside the target, then rank 0
renames it into place after every rank has finished: a crash mid-write leaves the previous
checkpoint untouched and never a half-written one under the final name (atomic, as kiln.io's
single-file checkpoints are).

`load_sharded` reads it into a model parallelized for *any* mesh: DCP stores each tensor with its
global shape and every shard's offsets, so loading into other placements (dp_shard=4 written,
dp_shard=2 x tp=2 read) is a resharding read, not a conversion step. Parameter names are the HF names
(kiln.dist.parallelize unmerges q/k/v and gate/up), so the keys match across meshes; optimizer state
is keyed by those names too (`get_state_dict`), flattened (`state.<name>.exp_avg`,
`param_groups.<name>.lr`): pipeline stages hold different parameters, and a per-group list of names
would differ from stage to stage under one key.

The model's config goes beside the shards as `model.json` (when the model has one), so that
`kiln convert DIR OUT` exports the directory to one HF-format safetensors directory in one process
(kiln.model.checkpoint.load_sharded_model); torch's own
`python -m torch.distributed.checkpoint.format_utils dcp_to_torch_save DIR FILE` also works.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from kiln.errors import KilnError

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def save_sharded(path: str | Path, model: nn.Module, optimizer, extra: dict | None = None,
                 files: dict[str, bytes] | None = None) -> Path:  # fmt: skip
    """Write a sharded checkpoint at `path` (a directory) atomically; every rank calls it.
    `extra`: small replicated values (step, loader position) saved beside the tensors. `files`: name ->
    bytes that rank 0 writes into the directory before it is renamed into place."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt
        if path.exists():
            raise KilnError(
                f"{path} exists: a checkpoint is never overwritten; remove it or pick another name"
            )
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    dcp.save({"model": model_sd, "optimizer": optim_sd, "extra": dict(extra or {})}, checkpoint_id=str(tmp))
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        config = getattr(model, "config", None)  # a pipeline stage keeps the whole model's config too
        if config is not None:  # what `kiln convert` needs to rebuild the model in one process
            (tmp / "model.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
        os.replace(tmp, path)
    dist.barrier()
    return path


def load_sharded(path: str | Path, model: nn.Module, optimizer, extra: dict | None = None) -> dict:
    """Load a `save_sharded` checkpoint into `model` / `optimizer` on this mesh. `extra`: the keys of
    the saved extras with values of their types (DCP reads the keys it is given); returns them filled."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise KilnError(f"{path} is not a sharded kiln checkpoint (no DCP .metadata in it)")
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    state = {"model": model_sd, "optimizer": optim_sd, "extra": dict(extra or {})}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=OPTIONS,
    )
    return state["extra"]
