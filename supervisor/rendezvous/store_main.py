"""The rendezvous store's own process: serves torch's TCPStore from the socket the
supervisor bound (`supervisor.rendezvous.store.HostedStore`), until killed.

    python -m supervisor.rendezvous.store_main LISTEN_FD PORT TIMEOUT_S ADDR
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

STORE_NICENESS = 5  # workers' own torch imports come first on a machine short of cores


def serve(listen_fd: int, port: int, timeout_s: float, addr: str) -> None:
    os.nice(STORE_NICENESS)
    from torch.distributed import TCPStore

    _store = TCPStore(addr, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                      master_listen_fd=listen_fd)
    while True:  # the store runs in torch's own threads; we only stay alive until killed
        signal.pause()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
