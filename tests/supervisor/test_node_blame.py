"""How a node other than 0 names the job's cause when its own failure may be another
node's consequence: driven through `MultiNode.settle` with a stand-in job link."""

from __future__ import annotations

from gpuherd.exit_codes import ExitCode
from supervisor.rendezvous.multi import MultiNode
from supervisor.summary import RootCause

LOST = "lost the job store at 10.0.0.1:29400 (node 0 gone?): no answer for 10 s (node 0's machine or its node agent stopped, or the network to it)"
HANG = RootCause("hang", ExitCode.HANG, "hang: rank 1 (every rank waits in a collective at the same step)", rank=1)


class StandInLink:
    def __init__(self, silent=(), lost_during_check: str | None = None):
        self.silent, self.lost_during_check = [RootCause.from_dict(d) for d in silent], lost_during_check
        self.lost: str | None = None
        self.moved_out: str | None = None  # node 0 moved this node out (its words)

    def winner(self, attempt, timeout=3.0):
        return None  # the store never answered

    def silent_nodes(self, attempt):
        self.lost = self.lost_during_check  # the agent's store watchdog fires while it asks
        return self.silent


def node(rank: int, link: StandInLink) -> MultiNode:
    n = MultiNode.__new__(MultiNode)
    n.node_rank, n.host, n.link, n._rounds = rank, f"node{rank + 1}", link, {}
    return n


def test_a_hang_on_a_node_cut_off_from_the_store_is_the_cut():
    notes: list[str] = []
    cause = node(1, StandInLink(lost_during_check=LOST)).settle(0, HANG, notes)
    assert cause.kind == "node" and cause.message == LOST and cause.exit_code == ExitCode.FAILURE
    assert any("a consequence of that, not the cause" in n and "hang: rank 1" in n for n in notes)


def test_a_hang_with_the_store_answering_stays_a_hang():
    notes: list[str] = []
    cause = node(1, StandInLink()).settle(0, HANG, notes)
    assert cause.kind == "hang" and cause.message.startswith("node 1 (node2): hang: rank 1")
    assert not any("consequence" in n for n in notes)


def test_a_silent_node_outranks_the_lost_store():
    silent = {"kind": "node", "exit_code": 1, "message": "node 2 (node3) stopped responding", "node": 2}
    cause = node(1, StandInLink(silent=[silent], lost_during_check=LOST)).settle(0, HANG, [])
    assert cause.message == "node 2 (node3) stopped responding"


def test_node_0_never_blames_a_store_it_hosts():
    link = StandInLink(lost_during_check="the node agent (job store link to 127.0.0.1:29400) exited")
    cause = node(0, link).settle(0, HANG, [])
    assert cause.kind == "hang"


def test_a_node_moved_out_by_node_0_ends_its_attempt_with_no_cause_and_the_verdict_as_a_note():
    """Its workers were stopped as node 0 asked: nothing failed here, nothing is published or restarted."""
    link = StandInLink()
    link.moved_out = "node 1 computed 4.00x the median of the other nodes for 30 s"
    moved = RootCause("straggler", ExitCode.OK, f"this node was moved out of the job by node 0: {link.moved_out}")
    notes: list[str] = []
    assert node(1, link).settle(0, moved, notes) is None
    assert notes == [moved.message]
    assert node(1, link).settle(0, HANG, []).kind == "hang"  # another cause is still this node's cause
