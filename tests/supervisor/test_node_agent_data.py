"""The node agent against values no node of the job wrote (the store has no authentication):
each is named by its key as the job's cause, and no agent crashes on it."""

from __future__ import annotations

from supervisor.rendezvous.node_agent_main import Agent


class DictStore:
    """The few TCPStore calls the agent makes, on a dict."""

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values = values

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]

    def set(self, key: str, value: bytes) -> None:
        self.values[key] = value

    def compare_set(self, key: str, expected: str, value: bytes) -> bytes:
        return self.values.setdefault(key, value)


def _agent(values: dict[str, bytes]) -> tuple[Agent, list[dict]]:
    agent = Agent(DictStore(values), node_rank=0, nnodes=2, join_timeout=1.0, where="10.0.0.1:29500")
    events: list[dict] = []
    agent.emit = lambda event, **fields: events.append({"event": event, **fields})
    return agent, events


def test_a_join_record_that_is_not_one_is_named_with_its_node():
    agent, events = _agent({"a0/node1": b"\x00garbage"})
    agent.handle({"cmd": "join", "attempt": 0, "record": {"host": "h0", "nproc": 1}})
    assert [e["event"] for e in events] == ["abort", "join-aborted"]
    cause = events[0]["cause"]
    assert cause["kind"] == "store" and cause["exit_code"] == 1
    assert "key a0/node1 holds" in cause["message"] and "not node 1's join record" in cause["message"]


def test_an_abort_that_is_not_a_root_cause_is_named_and_a_foreign_beat_is_only_compared():
    agent, events = _agent({"a0/abort": b"[1, 2]", "a0/beat1": b"not a number"})
    agent.handle({"cmd": "watch", "attempt": 0})
    agent.poll()
    assert events[0]["event"] == "abort" and "key a0/abort holds '[1, 2]'" in events[0]["cause"]["message"]
    agent.watching, agent.next_beat = 0, 0.0
    agent.store.values.pop("a0/abort")
    agent.poll()  # reads node 1's beat: a value it never parses
    assert agent.store.values["a0/beat0"] == b"1" and not events[1:]
