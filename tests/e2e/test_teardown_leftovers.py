"""The launcher's exit code comes after every process it started is gone: a worker SIGKILLed
mid-run (a fresh run directory and dataset cache each time, so the build's tokenizer pool, its
forkserver and resource tracker run too), and the moment the exit code arrives nothing the
launcher started is left, not even exited and unreaped. bench/teardown_leftovers.py does 20
rounds; CI does two."""

from __future__ import annotations

from bench.teardown_leftovers import one_round

ROUNDS = 2


def test_no_process_the_launcher_started_is_left_when_its_exit_code_arrives(tmp_path):
    for n in range(ROUNDS):
        work = tmp_path / f"round{n}"
        work.mkdir()
        assert one_round(work, [], work / "cache") == [], f"round {n + 1}"
