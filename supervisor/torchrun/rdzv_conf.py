"""torchrun's `--rdzv-conf key=value,...`: the keys gpuherd gives a meaning, and the rest named.

torch parses it the same way (torch.distributed.elastic.rendezvous.utils._parse_rendezvous_config):
comma-separated `key=value`, both stripped, neither empty. `join_timeout` (seconds a node
waits for the others to join) is gpuherd's `system.rendezvous_timeout`, `last_call_timeout`
(an elastic job's wait for more nodes once MIN joined) `system.rendezvous_last_call`; the keys that tune
torch's own rendezvous machinery (keep-alives, store timeouts, the store's flavour) have no
gpuherd counterpart: they are accepted and named once at INFO.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuherd.cli import die

_NO_EFFECT = {
    "close_timeout": "the job store stays up until every node left (at most 30 s)",
    "read_timeout": "gpuherd's job store has its own timeouts",
    "timeout": "gpuherd's job store has its own timeouts",
    "keep_alive_interval": "nodes beat every 1 s and count as gone after 10 s still",
    "keep_alive_max_attempt": "nodes beat every 1 s and count as gone after 10 s still",
    "heartbeat": "nodes beat every 1 s and count as gone after 10 s still",
    "is_host": "node 0 (--node-rank 0) hosts the job store",
    "store_type": "gpuherd's job store is a TCPStore",
    "use_libuv": "gpuherd's job store is a TCPStore",
    "rank": "the node's rank is --node-rank",
}


_SECONDS = {"join_timeout": "rendezvous_timeout", "last_call_timeout": "rendezvous_last_call"}


@dataclass
class RdzvConf:
    overrides: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)


def parse_rdzv_conf(text: str) -> RdzvConf:
    """`--rdzv-conf` -> config overrides and notices; exit 2 with one line on a malformed one."""
    out = RdzvConf()
    ignored: dict[str, str] = {}
    for item in (part for part in text.split(",") if text.strip()):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not key or not sep or not value:
            die(f"--rdzv-conf {text!r}: expected key=value,... (e.g. join_timeout=900), got {item.strip()!r}")
        if key in _SECONDS:
            try:
                seconds = float(value)
            except ValueError:
                die(f"--rdzv-conf {key}={value}: expected seconds")
            out.overrides.append(f"system.{_SECONDS[key]}={seconds:g}")
        else:
            ignored[key] = _NO_EFFECT.get(key, "not a setting gpuherd's rendezvous has")
    if ignored:
        out.notices.append("--rdzv-conf " + "; ".join(f"{key}: no effect here ({why})" for key, why in ignored.items()))
    return out
