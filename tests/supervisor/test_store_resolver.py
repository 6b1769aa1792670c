"""A process that hosts a torch TCPStore server looks up the name of each client it accepts (torch's
getnameinfo, for its logs), on the server's one thread, until one lookup fails. Where reverse DNS
is dropped (a firewall, a resolver that never answers), glibc's default wait held the store's
first accept, and every connection queued behind it, for 10 s: these tests hold the bound."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from supervisor.rendezvous.job_link import JobLink
from supervisor.rendezvous.nodes import NodeSpec
from supervisor.rendezvous.store import STORE_RES_OPTIONS, StoreServer, store_host_env


def test_a_store_hosts_env_bounds_the_resolver_and_keeps_the_users_options_last_so_they_win():
    assert store_host_env({"PATH": "/bin"}) == {"PATH": "/bin", "RES_OPTIONS": STORE_RES_OPTIONS}
    theirs = {"RES_OPTIONS": " timeout:3 rotate "}
    mine = store_host_env(theirs)["RES_OPTIONS"]
    assert mine == f"{STORE_RES_OPTIONS} timeout:3 rotate"  # glibc reads left to right: theirs override
    assert theirs == {"RES_OPTIONS": " timeout:3 rotate "}  # the caller's dict is untouched


def test_the_store_helper_is_started_with_the_bounded_resolver():
    server = StoreServer(sys.executable, {"PATH": "/bin"}, lambda: None)
    assert server._env["RES_OPTIONS"] == STORE_RES_OPTIONS


class _Blackhole:
    """A DNS server that takes every query and never answers: when each query came, and from which
    port (a lookup asks from one port, its tries `timeout` apart)."""

    def __init__(self, addr: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((addr, 53))
        self.sock.settimeout(0.2)
        self.queries: list[tuple[int, float]] = []
        self.done = False
        self.thread = threading.Thread(target=self._take, daemon=True)
        self.thread.start()

    def _take(self) -> None:
        while not self.done:
            try:
                _data, (_addr, port) = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            self.queries.append((port, time.monotonic()))

    def lookups(self) -> list[list[float]]:
        """Each lookup's tries: when each came."""
        by_port: dict[int, list[float]] = {}
        for port, at in self.queries:
            by_port.setdefault(port, []).append(at)
        return list(by_port.values())

    def close(self) -> None:
        self.done = True
        self.thread.join()
        self.sock.close()


# Inside the mount namespace: the store helper serves one store (its own client is its first
# accept: the server looks that client up), then a client of ours connects and is served.
DRIVER = """
import os, sys
from datetime import timedelta
from supervisor.rendezvous.store import HostedStore, StoreServer
env = dict(os.environ)
env.pop("RES_OPTIONS")  # the helper's resolver is the supervisor's doing alone
server = StoreServer(sys.executable, env, lambda: None)
store = HostedStore(timeout_s=60)
server.serve(store)
from torch.distributed import TCPStore
client = TCPStore(store.addr, store.port, None, False, timedelta(seconds=60))
client.set("k", "v")
server.close()
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root: a mount namespace for resolv.conf and /etc/hosts, a DNS port")
def test_where_reverse_dns_never_answers_the_stores_lookup_gives_up_within_the_bound(tmp_path, python_env):
    """Reverse DNS that is dropped: /etc/hosts without 127.0.0.1 and a nameserver that never answers,
    in a mount namespace of the helper's own. The store's lookup gives up after 2 tries 1 s apart
    (about 2 s, after which torch stops looking up), where glibc's default waited 5 s a try, 10 s."""
    (tmp_path / "hosts").write_text("# no name for 127.0.0.1: its lookup goes to the nameserver\n")
    tried = subprocess.run(["unshare", "-m", "mount", "--bind", str(tmp_path / "hosts"), "/etc/hosts"],
                           capture_output=True, text=True)
    if tried.returncode != 0:
        pytest.skip(f"no mount namespace here: {tried.stderr.strip()[-200:]}")
    addr = f"127.53.{os.getpid() % 250 + 1}.{threading.get_ident() % 250 + 1}"
    try:
        blackhole = _Blackhole(addr)
    except OSError as exc:
        pytest.skip(f"no DNS port on {addr}: {exc}")
    (tmp_path / "resolv.conf").write_text(f"nameserver {addr}\n")
    script = (f"mount --bind {tmp_path / 'resolv.conf'} /etc/resolv.conf && "
              f"mount --bind {tmp_path / 'hosts'} /etc/hosts && exec {sys.executable} -c \"$DRIVER\"")
    # A TCPStore client looks up the server's name too (at its connect): the driver's lookup tries
    # once, so every lookup tried twice is the helper's, whose resolver is the supervisor's doing.
    env = {**python_env, "DRIVER": DRIVER, "RES_OPTIONS": "timeout:1 attempts:1"}
    try:
        done = subprocess.run(["unshare", "-m", "bash", "-c", script], env=env, capture_output=True, text=True,
                              timeout=120)
    finally:
        blackhole.close()
    assert done.returncode == 0, done.stderr[-3000:]
    lookups = blackhole.lookups()
    assert any(len(tries) == 2 for tries in lookups), f"the store never looked its client up twice: {lookups}"
    # 1 s apart, with a margin for a loaded machine's scheduling; glibc's default: 5 s apart
    waits = [later - earlier for tries in lookups for earlier, later in zip(tries, tries[1:])]
    assert max(waits) < 4.0, f"a lookup's tries came {max(waits):.1f} s apart: {lookups}"


@pytest.mark.parametrize("node_rank", [0, 1])
def test_node_0s_agent_hosts_the_job_store_with_the_bounded_resolver_and_the_others_keep_the_users(
        tmp_path, node_rank):
    """A stand-in agent (a script in the python's place) writes the RES_OPTIONS it was started with."""
    fake, seen = tmp_path / "python", tmp_path / "res_options"
    fake.write_text(f"#!/bin/sh\nprintf '%s' \"$RES_OPTIONS\" > {seen}\ncat > /dev/null\n")
    fake.chmod(0o755)
    spec = NodeSpec(nnodes=2, node_rank=node_rank, master_addr="127.0.0.1", master_port=1)
    link = JobLink(spec, 5.0, str(fake), {"RES_OPTIONS": "rotate"}, lambda: None, tmp_path / "agent.log", None)
    try:
        deadline = time.monotonic() + 30
        while not seen.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        link.close(linger=0.1)
    assert seen.read_text() == (f"{STORE_RES_OPTIONS} rotate" if node_rank == 0 else "rotate")
