"""The hang detector: a collective that does not finish in time becomes an error naming the rank and op.

Every collective of the process group carries the group's timeout (`init_process_group(timeout=)`,
set from `parallel.hang_timeout_s`): gloo raises when a send/receive waits longer, NCCL's watchdog
aborts the communicator. A dead peer shows up sooner, as a closed connection. Either way PyTorch
raises `DistBackendError` (a RuntimeError) with the backend's message, which names the operation;
`collective_errors(rank)` turns it into one KilnError line (the CLI prints it and exits 2) that says
which rank saw it, what it waited for, and what usually causes it, instead of a traceback or a hang.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch.distributed as dist

from kiln.errors import KilnError

_SIGNS = re.compile(r"timed out|timeout|connection closed|connection reset|broken pipe|peer", re.IGNORECASE)


@contextlib.contextmanager
def collective_errors(rank: int, timeout_s: float) -> Iterator[None]:
    """Re-raise a failed or timed-out collective inside the block as a KilnError naming `rank`."""
    try:
        yield
    except RuntimeError as e:  # DistBackendError subclasses RuntimeError
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not (isinstance(e, getattr(dist, "DistBackendError", ())) or _SIGNS.search(msg)):
            raise
        raise KilnError(
            f"rank {rank}: a collective failed or did not finish within parallel.hang_timeout_s={timeout_s:g}s "
            f"({msg}); another rank has probably died or is stuck: see its log, the first error there is "
            "the cause"
        ) from None
