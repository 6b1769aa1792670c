"""A plain TCP connection from every node's agent to node 0's: a node whose processes died
is seen the moment the kernel closes its socket, not after a silence.

The job store cannot tell: torch's `TCPStore` server drops a closed client without a
word. So node 0's agent listens on one more port of the same interface (published as the
store key `liveness`), every other agent connects once it has joined and says
`hello {rank} {claim}` (its claim on the rank, `rank{r}/owner`: rank_claims.py), and says `bye`
before it leaves. A connection that ends without `bye`
is a node whose agent died (SIGKILL, OOM, its supervisor killed with it, its machine
rebooted): node 0 names it at once. A node cut off without anything closing (a machine
that lost power, a cable) still falls to the heartbeat silence rule. The other way
round, a node whose connection to node 0 ends without node 0 having left is cut off
from node 0's agent (it died) and says so at once. A newer `hello` for the same rank (the node
started again, a spare node given its place) replaces an older connection: the older one's end
is no death (the frozen agent it came from may still wake and close it).

The same connection carries each node's console lines for folding across nodes
(`lines {JSON list}`, supervisor/output/cross_node.py), so the job store never does, and, the
other way, node 0's word to a node it moves out as a straggler (`out {message}`,
node_move_out.py): that node stops its workers and drops this connection without `bye`, which
node 0 then reads as the node's end, named by the move.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import sys
import threading
from collections.abc import Callable

LIVENESS_KEY = "liveness"  # node 0's "host:port" for these connections
HELLO, BYE, LINES, OUT = b"hello ", b"bye", b"lines ", b"out "


class LivenessServer:
    """Node 0: accepts every node's connection; `on_closed(rank, claim)` when one ends without `bye`
    (`claim`: what its `hello` said after the rank, None if nothing)."""

    def __init__(self, host: str, on_closed: Callable[[int, bytes | None], None],
                 on_lines: Callable[[int, bytes], None] | None = None) -> None:
        """`on_lines(rank, payload)`: a node's console lines (the JSON list it sent)."""
        self._on_closed, self._on_lines = on_closed, on_lines
        self._listen = socket.create_server((host, 0), backlog=4096)
        self.port = self._listen.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, selectors.EVENT_READ)
        self._state: dict[socket.socket, list] = {}  # connection -> [rank or None, said bye, unparsed bytes, claim]
        threading.Thread(target=self._serve, name="liveness-server", daemon=True).start()

    def _serve(self) -> None:
        while True:
            for key, _ in self._sel.select():
                if key.fileobj is self._listen:
                    conn, _addr = self._listen.accept()
                    self._state[conn] = [None, False, b"", None]
                    self._sel.register(conn, selectors.EVENT_READ)
                else:
                    self._read(key.fileobj)

    def _read(self, conn: socket.socket) -> None:
        state = self._state[conn]
        try:
            chunk = conn.recv(4096)
        except OSError:
            chunk = b""
        if chunk:
            state[2] += chunk
            *lines, state[2] = state[2].split(b"\n")
            for line in lines:
                rank, _, claim = line[len(HELLO):].partition(b" ")
                if line.startswith(HELLO) and rank.isdigit():
                    self._hello(conn, int(rank), claim or None)
                elif line == BYE:
                    state[1] = True
                elif line.startswith(LINES) and state[0] is not None and self._on_lines is not None:
                    self._on_lines(state[0], line[len(LINES):])
            return
        self._sel.unregister(conn)
        conn.close()
        del self._state[conn]
        rank, said_bye = state[0], state[1]
        if rank is not None and not said_bye:
            self._on_closed(rank, state[3])

    def speaks_for(self, rank: int) -> bool:
        """A connection that said `hello {rank}` is open."""
        return any(state[0] == rank for state in list(self._state.values()))

    def send_out(self, rank: int, message: str) -> bool:
        """Node `rank` is told it is moved out (`message`: why, one line); False: no connection of
        its is open (it never connected, or it is gone)."""
        line = OUT + " ".join(message.split()).encode() + b"\n"
        for conn, state in list(self._state.items()):
            if state[0] == rank:
                try:
                    conn.sendall(line)
                    return True
                except OSError:
                    return False
        return False

    def _hello(self, conn: socket.socket, rank: int, claim: bytes | None) -> None:
        """`conn` speaks for node `rank` from now on; an older connection for it is replaced."""
        for other, state in self._state.items():
            if other is not conn and state[0] == rank:
                state[0] = None
        self._state[conn][0], self._state[conn][3] = rank, claim


class LivenessLink:
    """A node other than 0: its connection to node 0's agent; `on_closed()` when node 0's end closes."""

    def __init__(self, host: str, port: int, node_rank: int, on_closed: Callable[[], None], claim: bytes = b"",
                 on_out: Callable[[str], None] | None = None) -> None:
        """`claim`: this agent's on its rank (rank_claims.owner_mark): node 0 frees it when this ends;
        `on_out(message)`: node 0 moves this node out (its words)."""
        self._sock = socket.create_connection((host, port), timeout=10)
        self._sock.settimeout(None)
        self._claim = claim
        self._sock.sendall(self._hello_line(node_rank))
        self._on_closed, self._on_out = on_closed, on_out
        self._leaving = False
        threading.Thread(target=self._watch, name="liveness-link", daemon=True).start()

    def _watch(self) -> None:
        unparsed = b""
        with contextlib.suppress(OSError):
            while chunk := self._sock.recv(4096):
                *lines, unparsed = (unparsed + chunk).split(b"\n")
                for line in lines:
                    if line.startswith(OUT) and self._on_out is not None:
                        self._on_out(line[len(OUT):].decode(errors="replace"))
        if not self._leaving:
            self._on_closed()

    def hello(self, node_rank: int) -> None:
        """This connection speaks for node `node_rank` from now on (a spare node taking its place)."""
        with contextlib.suppress(OSError):
            self._sock.sendall(self._hello_line(node_rank))

    def _hello_line(self, node_rank: int) -> bytes:
        return HELLO + str(node_rank).encode() + (b" " + self._claim if self._claim else b"") + b"\n"

    def send_lines(self, payload: bytes) -> None:
        """This node's console lines for node 0's folding point (one JSON list, no newline in it)."""
        with contextlib.suppress(OSError):
            self._sock.sendall(LINES + payload + b"\n")

    def bye(self) -> None:
        """This node leaves the job: its connection's end is no death."""
        self._leaving = True
        with contextlib.suppress(OSError):
            self._sock.sendall(BYE + b"\n")

    def drop(self) -> None:
        """Close without a word, as a killed process's kernel does (the scale harness's node death)."""
        self._leaving = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def link_to_node0(where: str | None, read_key: Callable[[str], bytes | None], node_rank: int,
                  on_closed: Callable[[], None], claim: bytes, silent_s: float,
                  on_out: Callable[[str], None] | None = None) -> LivenessLink | None:
    """A node other than 0: its connection to node 0's agent. `where`: node 0's "host:port" as its
    join record carries it (no request); else `read_key(LIVENESS_KEY)` from the store. None: node 0
    has none (a test's store), or it could not be reached (said): the heartbeat silence rule holds."""
    if not isinstance(where, str):
        raw = read_key(LIVENESS_KEY)
        if raw is None:
            return None
        where = raw.decode(errors="replace")
    host, _, port = where.rpartition(":")
    try:
        return LivenessLink(host, int(port), node_rank, on_closed, claim, on_out)
    except (OSError, ValueError) as exc:
        print(f"node agent: no direct connection to node 0's agent at {where!r} ({exc}); a dead node is "
              f"named after {silent_s:g} s of silence instead", file=sys.stderr, flush=True)
        return None
