"""The rendezvous store's own process: serves each attempt's torch TCPStore from the
socket the supervisor bound and handed over (`supervisor.rendezvous.store.StoreServer`).

    python -m supervisor.rendezvous.store_main CONTROL_FD

CONTROL_FD is a SOCK_SEQPACKET socket. Each message is a JSON object; one that carries
a file descriptor (a listening socket) with {"addr", "port", "timeout_s"} replaces the
store being served by a fresh one on that socket; `{"set": {KEY: VALUE}}` writes keys into the
store being served (the supervisor's word to the workers, e.g. a live recovery's decision: the
supervisor itself stays torch-free); `{}` alone just stops the current one.
End of file (the supervisor is gone) ends the process.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import orjson

STORE_NICENESS = 5  # workers' own torch imports come first on a machine short of cores
MAX_MESSAGE = 4096


def serve(control_fd: int) -> None:
    os.nice(STORE_NICENESS)
    from torch.distributed import TCPStore

    control = socket.socket(fileno=control_fd)
    serving: list[TCPStore] = []  # held, or its server would stop
    while True:
        message, fds, _flags, _addr = socket.recv_fds(control, MAX_MESSAGE, 1)
        if not message:
            return
        spec = orjson.loads(message)
        if "set" in spec and not fds:
            for key, value in spec["set"].items():
                if serving:
                    serving[-1].set(key, value)
            continue
        serving.clear()  # the previous attempt's store: its server stops and closes its socket
        if fds:
            # The store owns the listening fd from here and closes it when replaced.
            serving.append(TCPStore(spec["addr"], spec["port"], None, True, timedelta(seconds=spec["timeout_s"]),
                                    wait_for_workers=False, master_listen_fd=fds[0]))


if __name__ == "__main__":
    serve(int(sys.argv[1]))
