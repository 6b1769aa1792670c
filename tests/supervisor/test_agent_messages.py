"""The node agent's commands and events (agent_messages.py): each declared once, decoded once where
it enters (the agent's `handle`, the job link's reader); a line that is none of them is said in one
line naming what was dropped, and neither end crashes on it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from loguru import logger

from supervisor.rendezvous import agent_messages as am
from supervisor.rendezvous.job_link import JobLink
from supervisor.rendezvous.nodes import NodeLinkError, NodeSpec

CAUSE = {"kind": "node", "exit_code": 1, "message": "node 1 (h1) stopped responding", "node": 1}
SAMPLES: list[am.Command | am.Event] = [
    am.Join(attempt=0, record={"host": "h0", "nproc": 2}), am.Watch(attempt=1), am.PublishAbort(attempt=1, cause=CAUSE),
    am.Done(attempt=1), am.WaitDone(attempt=1, timeout=5.0), am.CheckAlive(attempt=1),
    am.ShareOutcome(outcome={"exit_code": 0}), am.GatherOutcomes(timeout=5.0), am.Leave(),
    am.ShareLines(records=[{"text": "x"}]), am.Linger(timeout=30.0),
    am.ClaimRegroup(attempt=1, generation=2, claim={"rank": 3}), am.WatchRegroups(attempt=1),
    am.StandBy(attempt=0, record={"host": "h9", "nproc": 2}),
    am.Waiting(attempt=1, round=1, members=[0, 1]), am.Joined(attempt=1, round=1, members=[0], nodes=[{"nproc": 1}]),
    am.JoinTimedOut(attempt=0, missing=[1], timeout=5.0), am.JoinClosed(attempt=2), am.JoinAborted(attempt=2),
    am.Aborted(attempt=1, cause=CAUSE), am.Finished(attempt=1, missing=[]), am.AliveChecked(attempt=1, silent=[CAUSE]),
    am.Outcomes(ranks=[1, 2], nodes=[{"exit_code": 0}, None]), am.Lines(node=1, records=[{"text": "x"}]),
    am.Lingered(missing=[2]), am.RegroupClaimed(attempt=1, generation=1, won=False, claim=None),
    am.Regrouped(attempt=1, generation=1, claim={"rank": 3}), am.StandingBy(attempt=1, nodes=[{"nproc": 1}]),
    am.Promoted(attempt=1, generation=1, node=1, claim={"rank": 2}, nodes=[{"nproc": 1}]),
    am.SpareClosed(attempt=1), am.SpareRefused(attempt=1, message="no", exit_code=2),
    am.SparePassedOver(attempt=1, message="frozen"), am.Lost(message="gone"),
    am.MoveNodeOut(attempt=1, node=2, message="node 2 computed 4.00x"),
    am.NodeMoveAnswer(attempt=1, node=2, why_not=None), am.NodeMoveAnswer(attempt=1, node=0, why_not="node 0 hosts"),
    am.MovedOut(attempt=1, message="node 2 computed 4.00x"),
]


def test_every_command_and_event_is_sampled_and_comes_back_as_it_was_sent():
    assert {type(m) for m in SAMPLES} == {*am.COMMANDS.values(), *am.EVENTS.values()}
    for message in SAMPLES:
        decode = am.decode_command if isinstance(message, am.Command) else am.decode_event
        assert decode(am.encode(message)) == message


def test_a_field_no_class_declares_is_ignored_and_a_whole_number_timeout_is_a_float():
    cmd = am.decode_command(b'{"cmd": "wait-done", "attempt": 3, "timeout": 5, "newer": true}')
    assert cmd == am.WaitDone(attempt=3, timeout=5.0) and isinstance(cmd.timeout, float)


@pytest.mark.parametrize(("line", "said"), [
    (b"not json", "dropped a line that is not JSON: not json"),
    (b"[1, 2]", "dropped a line that is not a JSON object: [1, 2]"),
    (b'{"cmd": "reboot"}', "dropped an unknown command: {\"cmd\": \"reboot\"}"),
    (b'{"attempt": 1}', "dropped an unknown command"),
    (b'{"cmd": "wait-done", "attempt": 1}', "dropped a 'wait-done' command without 'timeout'"),
    (b'{"cmd": "wait-done", "timeout": "soon"}', "dropped a 'wait-done' command whose 'timeout' is not float"),
    (b'{"cmd": "join", "attempt": true, "record": {}}', "whose 'attempt' is not int"),
    (b'{"cmd": "lines", "records": "x"}', "whose 'records' is not list"),
])
def test_a_line_that_is_no_command_is_refused_with_what_was_dropped(line, said):
    with pytest.raises(am.Malformed) as refused:
        am.decode_command(line)
    assert said in str(refused.value)


def test_an_event_of_the_wrong_shape_is_refused_too():
    with pytest.raises(am.Malformed, match="'joined' event without 'round', 'members', 'nodes'"):
        am.decode_event(b'{"event": "joined", "attempt": 0}')
    with pytest.raises(am.Malformed, match="'outcomes' event whose 'nodes' is not"):
        am.decode_event(b'{"event": "outcomes", "ranks": [1], "nodes": [3]}')


def test_the_agent_says_each_line_it_drops_in_one_line_and_keeps_serving(free_tcp_port):
    """A real agent (node 0 of one node, hosting its store) fed lines that are no command: each is
    said on its stderr, none ends it, and the valid command after them is still answered."""
    lines = b'not json\n{"cmd": "reboot"}\n{"cmd": "wait-done", "attempt": 0}\n{"cmd": "lines", "records": "x"}\n' \
            b'{"cmd": "outcomes", "timeout": 0.1}\n'
    agent = subprocess.run([sys.executable, "-m", "supervisor.rendezvous.node_agent_main", "0", "1:1", "127.0.0.1",
                            str(free_tcp_port), "10", "0"], input=lines, capture_output=True, timeout=120)
    said = [line for line in agent.stderr.decode().splitlines() if line.startswith("node agent: dropped")]
    assert len(said) == 4 and "Traceback" not in agent.stderr.decode(), agent.stderr.decode()
    assert said[0] == "node agent: dropped a line that is not JSON: not json"
    assert am.decode_event(agent.stdout) == am.Outcomes(ranks=[], nodes=[])
    assert agent.returncode == 0


def test_the_job_link_says_each_event_it_drops_and_still_hears_the_next(tmp_path: Path):
    """The job link's reader before an agent that writes lines no agent writes (a stand-in agent: a
    script in the python's place), then the store's loss: the drops are warnings, the loss is heard."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'not json'\necho '{\"event\": \"rebooted\"}'\n"
                    "echo '{\"event\": \"joined\", \"attempt\": 0}'\n"
                    "echo '{\"event\": \"lost\", \"message\": \"gone\"}'\n"
                    "cat > /dev/null\n")
    fake.chmod(0o755)
    warned: list[str] = []
    handler = logger.add(lambda m: warned.append(m.record["message"]), level="WARNING")
    link = JobLink(NodeSpec(nnodes=2, master_addr="127.0.0.1", master_port=1), 5.0, str(fake), {},
                   lambda: None, tmp_path / "agent.log", None)
    try:
        deadline = time.monotonic() + 30
        while link.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(NodeLinkError, match="gone"):
            link.join(0, {"host": "h0", "nproc": 1})
    finally:
        link.close(linger=0.1)
        logger.remove(handler)
    assert link.lost == "gone"
    assert warned == ["node agent: dropped a line that is not JSON: not json",
                      'node agent: dropped an unknown event: {"event": "rebooted"}',
                      'node agent: dropped a \'joined\' event without \'round\', \'members\', \'nodes\': '
                      '{"event": "joined", "attempt": 0}']


def test_the_job_link_hands_on_each_root_cause_decoded_and_names_one_it_cannot_read(tmp_path: Path):
    """Every node's supervisor gets the job's root cause as a `RootCause`, decoded once in the job
    link's reader; a kind this gpuherd does not know is named as such, not a crash of that reader."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    "echo '{\"event\": \"abort\", \"attempt\": 0, \"cause\": {\"kind\": \"node\", \"exit_code\": 1, "
                    "\"message\": \"node 1 (h1) stopped responding\", \"node\": 1, \"stop_after_s\": 99}}'\n"
                    "echo '{\"event\": \"abort\", \"attempt\": 1, \"cause\": {\"kind\": \"meteor\", \"exit_code\": 1, "
                    "\"message\": \"a meteor\"}}'\n"
                    "cat > /dev/null\n")
    fake.chmod(0o755)
    link = JobLink(NodeSpec(nnodes=2, master_addr="127.0.0.1", master_port=1), 5.0, str(fake), {},
                   lambda: None, tmp_path / "agent.log", None)
    heard: list = []
    try:
        link.watch(0, on_abort=heard.append, on_lost=lambda message: None)  # 99 s: past STOP_AFTER_MAX_S, at once
        first, second = link.winner(0, timeout=30), link.winner(1, timeout=30)
    finally:
        link.close(linger=0.1)
    assert (first.kind, first.node, first.message) == ("node", 1, "node 1 (h1) stopped responding")
    assert heard == [first]
    assert second.kind == "store" and second.message.startswith("the job's root cause came in a form this gpuherd "
                                                                "cannot read: {'kind': 'meteor'")


def test_every_event_the_agent_emits_is_declared_with_the_fields_it_is_given():
    """The agent's tests catch its events in place of `emit`, past the encoding: each `emit("name",
    field=...)` of the agent and its parts is checked here against its class instead."""
    import ast
    import dataclasses

    calls = []
    for path in sorted(Path(am.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            if (isinstance(func, ast.Attribute) and func.attr == "emit" or isinstance(func, ast.Name)
                    and func.id == "emit") and node.args and isinstance(node.args[0], ast.Constant):
                calls.append((f"{path.name}:{node.lineno}", node.args[0].value, {k.arg for k in node.keywords}))
    assert len(calls) >= 25
    for where, name, given in calls:
        assert name in am.EVENTS, where
        fields = dataclasses.fields(am.EVENTS[name])
        required = {f.name for f in fields if f.default is dataclasses.MISSING}
        assert required <= given <= {f.name for f in fields}, (where, name, given)


def test_the_node_silence_setting_reaches_the_agent_before_its_listen_fd(tmp_path: Path):
    """system.node_silence_timeout is the agent's SILENT_S (argv[6], before node 0's LISTEN_FD):
    a stand-in agent says the arguments it was given as its loss."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nshift 2\necho \"{\\\"event\\\": \\\"lost\\\", \\\"message\\\": \\\"$*\\\"}\"\n"
                    "cat > /dev/null\n")
    fake.chmod(0o755)
    link = JobLink(NodeSpec(nnodes=2, master_addr="127.0.0.1", master_port=1), 5.0, str(fake), {},
                   lambda: None, tmp_path / "agent.log", None, last_call=0.0, silent_s=25.0)
    try:
        deadline = time.monotonic() + 30
        while link.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        link.close(linger=0.1)
    assert link.lost == "0 2:2 127.0.0.1 1 5.0 0.0 25.0"  # node rank, MIN:MAX, host, port, join, last call, silence
