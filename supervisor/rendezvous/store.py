"""The run's torch TCPStore, on a port the supervisor holds from the first moment.

Why not a "free port" handed to rank 0: between probing and rank 0's bind another
job can take it (pytorch #126510). Here the supervisor binds 127.0.0.1:0 before
spawning anything and keeps the socket, so two jobs on one node never collide;
every rank is a store client (TORCHELASTIC_USE_AGENT_STORE=True, as under torchrun).

Why a separate process: `import torch` costs seconds of CPU. The supervisor stays
torch-free (its event loop never waits on an import holding the GIL); a small,
slightly niced process imports torch while the workers do and serves the store
from the already-bound socket (`master_listen_fd`). Workers that connect earlier
wait in the listen backlog. It dies with the supervisor like a worker does.

The store process itself is `store_main.py`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Callable

MASTER_ADDR = "127.0.0.1"


class HostedStore:
    def __init__(self, timeout_s: float = 1800.0, bind_addr: str = MASTER_ADDR,
                 listen: socket.socket | None = None) -> None:
        """`bind_addr`: loopback for a single-node run; node 0's chosen interface for a multi-node one.
        `listen`: serve from this already listening socket instead (its owner closes it)."""
        self._owned = listen is None
        if listen is None:
            listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listen.bind((bind_addr, 0))
            listen.listen(1024)  # every rank may connect before the store runs; none may be refused
        self._sock = listen
        self.addr, self.port = listen.getsockname()[:2]
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self, python: str, env: dict[str, str], preexec_fn: Callable[[], None]) -> subprocess.Popen:
        fd = self._sock.fileno()
        self.proc = subprocess.Popen(
            [python, "-m", "supervisor.rendezvous.store_main", str(fd), str(self.port), str(self.timeout_s), self.addr],
            env=env, pass_fds=(fd,),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            process_group=0, preexec_fn=preexec_fn,
        )
        return self.proc

    def failure(self) -> str:
        """Why the store process ended (its last stderr line), for the root cause."""
        if self.proc is None or self.proc.poll() is None:
            return ""
        try:
            err = self.proc.stderr.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            err = []
        return (f"the rendezvous store on {self.addr}:{self.port} exited with code {self.proc.returncode}"
                + (f": {err[-1]}" if err else ""))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        if self._owned:
            self._sock.close()
