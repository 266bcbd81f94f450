"""An exclusive lock on a directory, so that two processes never write one run at once.

`fcntl.flock` on `<dir>/.lock`: the kernel drops the lock when its holder exits, even by a crash or
SIGKILL, so a lock file left by a dead process is simply taken over (and said so). The file holds the
holder's pid and host for the message a second writer gets. Linux/macOS only (fcntl).
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from kiln.errors import KilnError

LOCK_FILE = ".lock"


class DirLock:
    """`with DirLock(run_dir):` holds the directory for this process; a second holder gets a KilnError.

    `previous` is the (pid, host) a stale lock file named when this one took it over, else None.
    """

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.path = self.dir / LOCK_FILE
        self.fd: int | None = None
        self.previous: tuple[int, str] | None = None

    def _holder(self) -> tuple[int, str] | None:
        try:
            pid, _, host = self.path.read_text().strip().partition(" ")
            return int(pid), host
        except (OSError, ValueError):
            return None

    def acquire(self) -> DirLock:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = self._holder()
            who = f"process {holder[0]} on {holder[1] or 'this host'}" if holder else "another process"
            raise KilnError(
                f"{self.dir} is in use by {who} (it holds {self.path}): wait for that run to finish, "
                "stop it, or choose another --out"
            ) from None
        except OSError as e:
            os.close(fd)
            raise KilnError(f"cannot lock {self.path}: {e.strerror or e}") from None
        holder = self._holder()
        if holder is not None:
            # a clean release empties the file, and the kernel gave us the lock, so its holder died
            # holding it: a stale lock, taken over
            self.previous = holder
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)  # no pid left behind to mislead the next reader
        except OSError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
