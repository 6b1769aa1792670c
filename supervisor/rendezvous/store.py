"""The workers' torch TCPStore, on a port the supervisor holds from the first moment.

Why not a "free port" handed to rank 0: between probing and rank 0's bind another
job can take it (pytorch #126510). Here the supervisor binds 127.0.0.1:0 before
spawning anything and keeps the socket (`HostedStore`, one per attempt), so two jobs
on one node never collide; every rank is a store client
(TORCHELASTIC_USE_AGENT_STORE=True, as under torchrun).

Why a fresh store per attempt: torch's env:// rendezvous does not prefix keys per
attempt (torch 2.13, rendezvous.py: "We create a new TCPStore for every retry"), so
one store reused across attempts would hand a restarted group the dead attempt's
keys, gloo's included (torchrun's stale-key restart failures).

Why one helper process for the whole job (`StoreServer`): `import torch` costs
seconds of CPU. The supervisor stays torch-free (its event loop never waits on an
import holding the GIL); a small, slightly niced process imports torch once, while
the first attempt's workers do, and then serves each attempt's store from the socket
the supervisor bound and hands over (SCM_RIGHTS over a socketpair): a restart gets a
fresh store at once, not after another torch import. Workers that connect before the
store serves wait in the listen backlog. It dies with the supervisor like a worker
does. The process itself is `store_main.py`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Callable

import orjson

MASTER_ADDR = "127.0.0.1"
# glibc's resolver options for a process that hosts a torch TCPStore server: the server looks up
# the name of every client it accepts (getnameinfo, for its logs) on its one thread, until a lookup
# fails. Where reverse DNS is dropped by a firewall, glibc's default (5 s, 2 tries) held the first
# accept 10 s, and every connection queued behind it; 1 s and 2 tries bound that to 2 s.
STORE_RES_OPTIONS = "timeout:1 attempts:2"


def store_host_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process that hosts a TCPStore server: the resolver's wait bounded (glibc reads
    RES_OPTIONS left to right, so options the user set there come after ours and win)."""
    theirs = env.get("RES_OPTIONS", "").strip()
    return {**env, "RES_OPTIONS": f"{STORE_RES_OPTIONS} {theirs}".strip()}


class HostedStore:
    """One attempt's store: the listening socket the workers are told about."""

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

    def fileno(self) -> int:
        return self._sock.fileno()

    def stop(self) -> None:
        """Our copy of the socket (unless a longer-lived owner holds it); the helper's copy
        goes when it is told to drop the store."""
        if self._owned:
            self._sock.close()


class StoreServer:
    """The job's store helper process: started on the first `serve`, kept warm across attempts."""

    def __init__(self, python: str, env: dict[str, str], preexec_fn: Callable[[], None]) -> None:
        self._python, self._env, self._preexec = python, store_host_env(env), preexec_fn
        self.proc: subprocess.Popen | None = None
        self._ctl: socket.socket | None = None
        self._serving = ""
        self._dying: subprocess.Popen | None = None  # SIGKILLed at the run's end, not reaped yet

    def reap(self) -> None:
        """The helper `close(wait=False)` killed: gone (reaped) when this returns."""
        if self._dying is not None:
            self._dying.wait()  # SIGKILLed: it ends as soon as the kernel has freed its memory
            self._dying = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def serve(self, store: HostedStore) -> subprocess.Popen:
        """Hand `store`'s socket to the helper (starting it if need be); it serves from now on."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        message = orjson.dumps({"addr": store.addr, "port": store.port, "timeout_s": store.timeout_s})
        try:
            socket.send_fds(self._ctl, [message], [store.fileno()])
        except OSError:
            pass  # the helper is gone: the supervision sees its death and says why (failure())
        self._serving = f"{store.addr}:{store.port}"
        return self.proc

    def set(self, key: str, value: str) -> bool:
        """Write `key` into the store being served (the workers read it); False: the helper is gone."""
        if self._ctl is None or self.proc is None or self.proc.poll() is not None:
            return False
        try:
            self._ctl.send(orjson.dumps({"set": {key: value}}))
        except OSError:
            return False
        return True

    def drop(self) -> None:
        """The attempt is over: its store stops serving (the port is free again)."""
        if self._ctl is not None and self.proc is not None and self.proc.poll() is None:
            try:
                self._ctl.send(b"{}")
            except OSError:
                pass

    def _start(self) -> None:
        self.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [self._python, "-m", "supervisor.rendezvous.store_main", str(theirs.fileno())],
                env=self._env, pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                process_group=0, preexec_fn=self._preexec,
            )
        finally:
            theirs.close()
        self._ctl = ours

    def failure(self) -> str:
        """Why the helper ended (its last stderr line), for the root cause."""
        if self.proc is None or self.proc.poll() is None:
            return ""
        try:
            err = self.proc.stderr.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            err = []
        return (f"the rendezvous store on {self._serving} exited with code {self.proc.returncode}"
                + (f": {err[-1]}" if err else ""))

    def close(self, wait: bool = True) -> int | None:
        """Kill the helper; returns its pid. `wait=False` (the run's end): not waited for now. A
        SIGKILLed process runs no more code, and the kernel's teardown of its memory (torch's:
        about 10 ms) then overlaps the end of the run (the summary's writing); `reap` collects it
        before the launcher's exit code, so no process the launcher started outlives that."""
        pid = None
        if self.proc is not None:
            pid = self.proc.pid
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                if wait:
                    self.proc.wait()
                else:
                    self._dying = self.proc
            if self.proc.stderr is not None:
                self.proc.stderr.close()
            self.proc = None
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None
        return pid
