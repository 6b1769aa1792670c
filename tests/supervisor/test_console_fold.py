"""The console folds what many ranks print alike into one line with the rank set, and loses
nothing: step lines and errors are shown as printed, every line stays in its rank's log file,
what is held is printed at the latest when the attempt ends."""

from __future__ import annotations


from supervisor.output import rank_set
from supervisor.output.console import STDERR
from supervisor.output.fold import LONE_AFTER, LineFolder, Source
from supervisor.output.router import FLOOD_LINES, LogRouter, WorkerLog
from tests.supervisor import helpers as sh

WARNING = b"WARNING | [GPU %d] the dataloader is 2x slower than the step"


class FakeConsole:
    """What the router hands the terminal, line by line (no threads, no timing)."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def write(self, fd: int, data: bytes) -> None:
        self.lines += data.splitlines()


def test_rank_sets_are_spelled_as_compact_ranges():
    assert rank_set.ranges([5, 0, 1, 2, 3, 3]) == "0-3,5"
    assert rank_set.ranges([7]) == "7" and rank_set.ranges([]) == ""
    assert rank_set.ranges([0, 2, 4, 5]) == "0,2,4-5"
    assert rank_set.devices("GPU", [0, 1, 2, 3, 5]) == "GPU[0-3,5]"
    assert rank_set.node_ranks(range(256), range(2048)) == "n[0-255]/r[0-2047]"


def test_a_warning_from_each_of_2048_ranks_on_256_nodes_is_one_line():
    sources = [Source(b"n%d/GPU%d:" % (r // 8, r % 8), "GPU", r % 8, r, r // 8) for r in range(2048)]
    folder = LineFolder(sources, gap=0.2, longest=1.0)
    now = 100.0
    for s in sources:  # arriving over 0.4 s: each twin comes well within the gap of the one before
        folder.add(STDERR, s, WARNING % s.device, now)
        now += 0.0002
    assert folder.due(now) == [(STDERR, b"n[0-255]/r[0-2047]:WARNING | [GPU *] the dataloader is 2x slower "
                                        b"than the step\n")]  # all 2,048 said it: out at once
    assert folder.next_deadline() is None


def test_a_warning_from_2048_ranks_on_one_node_is_one_line_and_every_log_keeps_its_own(tmp_path):
    logs = [WorkerLog(r, f"CPU{r}", tmp_path / f"worker-rank{r}-CPU{r}.log") for r in range(2048)]
    console = FakeConsole()
    router = LogRouter(logs, console)  # type: ignore[arg-type]
    for r in range(2048):
        router.feed(r, STDERR, b"WARNING | [CPU %d] the dataloader is slow\n" % r, 10.0 + r * 1e-5)
    router.close()
    assert console.lines == [b"CPU[0-2047]:WARNING | [CPU *] the dataloader is slow"]
    for r in (0, 1, 777, 2047):
        assert (tmp_path / f"worker-rank{r}-CPU{r}.log").read_bytes() == \
            b"CPU%d:WARNING | [CPU %d] the dataloader is slow\n" % (r, r)


def _sources(n: int) -> list[Source]:
    return [Source(b"GPU%d:" % i, "GPU", i, i) for i in range(n)]


def test_a_lone_line_waits_only_the_short_gap_and_twins_extend_it_up_to_a_limit():
    g = _sources(8)
    folder = LineFolder(g, gap=0.2, longest=1.0)
    folder.add(1, g[3], b"only rank 3 says this", 0.0)
    assert folder.due(0.19) == []
    assert folder.due(0.2) == [(1, b"GPU3:only rank 3 says this\n")]  # as if never held: its own prefix
    for i, t in enumerate((1.0, 1.15, 1.3, 1.45, 1.6, 1.75, 1.9)):  # 7 of 8, each 0.15 s after the last
        folder.add(1, g[i], WARNING % i, t)
    assert folder.due(1.99) == []  # still within the longest wait (first + 1.0)
    assert folder.due(2.0) == [(1, b"GPU[0-6]:WARNING | [GPU *] the dataloader is 2x slower than the step\n")]


def test_a_kind_of_line_only_one_rank_prints_stops_waiting_for_twins_until_another_rank_prints_it():
    """A script printing its own step line on rank 0: after LONE_AFTER lines of that shape with no
    twin, the next shows at once; rank 1 printing the same shape makes it wait for twins again."""
    g = _sources(4)
    folder = LineFolder(g, gap=0.2, longest=1.0)
    t = 0.0
    for step in range(LONE_AFTER):
        folder.add(1, g[0], b"step %d | loss %d.%02d" % (step, 3, step), t)
        assert folder.due(t + 0.19) == []  # held: a twin might still come
        assert folder.due(t + 0.2) == [(1, b"GPU0:step %d | loss 3.%02d\n" % (step, step))]
        t += 1.0
    folder.add(1, g[0], b"step 3 | loss 2.97", t)
    assert folder.due(t) == [(1, b"GPU0:step 3 | loss 2.97\n")]  # at once
    folder.add(1, g[1], b"step 3 | loss 2.97", t + 0.01)  # another rank prints that kind of line
    folder.add(1, g[0], b"step 4 | loss 2.95", t + 0.02)
    assert folder.due(t + 0.05) == []
    folder.add(1, g[1], b"step 4 | loss 2.95", t + 0.06)
    assert folder.due(t + 0.3) == [(1, b"GPU1:step 3 | loss 2.97\n"), (1, b"GPU[0-1]:step 4 | loss 2.95\n")]
    # a line of another shape from the same rank is held as before
    folder.add(1, g[0], b"saving a checkpoint", t + 1.0)
    assert folder.due(t + 1.1) == []


def test_step_lines_and_errors_are_never_folded_and_errors_do_not_wait(tmp_path):
    logs = [WorkerLog(r, f"GPU{r}", tmp_path / f"w{r}.log") for r in range(4)]
    console = FakeConsole()
    router = LogRouter(logs, console)  # type: ignore[arg-type]
    for r in range(4):
        router.feed(r, STDERR, b"INFO | [GPU %d] Step [0/100] | Loss: 12.2340 | LR: 1.00e-05\n" % r, 0.0)
    router.feed(0, STDERR, b"INFO | [GPU 0] building the model\n", 0.01)
    router.feed(1, STDERR, b"INFO | [GPU 1] building the model\n", 0.02)
    assert len(console.lines) == 4  # the step lines, each rank's own; the model line is held for its twins
    router.feed(2, STDERR, b"Traceback (most recent call last):\n  File \"train.py\", line 9\n"
                           b"RuntimeError: CUDA error: an illegal memory access\n", 0.03)
    router.feed(3, STDERR, b"ERROR | [GPU 3] NCCL watchdog timeout\n", 0.04)
    assert console.lines == [b"GPU%d:INFO | [GPU %d] Step [0/100] | Loss: 12.2340 | LR: 1.00e-05" % (r, r)
                             for r in range(4)] + [
        b"GPU[0-1]:INFO | [GPU *] building the model",  # what was held goes first, as it came
        b"GPU2:Traceback (most recent call last):", b"GPU2:  File \"train.py\", line 9",
        b"GPU2:RuntimeError: CUDA error: an illegal memory access",
        b"GPU3:ERROR | [GPU 3] NCCL watchdog timeout"]
    router.close()


def test_collapse_logs_folds_step_lines_too_and_a_users_own_prefix_is_never_folded(tmp_path):
    logs = [WorkerLog(r, f"GPU{r}", tmp_path / f"w{r}.log") for r in range(2)]
    console = FakeConsole()
    router = LogRouter(logs, console, collapse=True)  # type: ignore[arg-type]
    for r in range(2):
        router.feed(r, STDERR, b"INFO | [GPU %d] Step [1/9] | Loss: 3.0000\n" % r, 0.0)
    assert console.lines == [b"GPU[0-1]:INFO | [GPU *] Step [1/9] | Loss: 3.0000"]
    torchrun = [WorkerLog(r, f"GPU{r}", tmp_path / f"t{r}.log", prefix=f"[default{r}]:") for r in range(2)]
    console = FakeConsole()
    router = LogRouter(torchrun, console)  # type: ignore[arg-type]
    for r in range(2):
        router.feed(r, STDERR, b"same words\n", 0.0)
    assert console.lines == [b"[default0]:same words", b"[default1]:same words"]


def test_other_ranks_warnings_fold_on_a_node_of_a_multi_node_job(tmp_path):
    """Multi-node, built-in trainer: the console shows rank 0's lines and every rank's warnings."""
    logs = [WorkerLog(8 + r, f"GPU{r}", tmp_path / f"w{r}.log", prefix=f"n1/GPU{r}:") for r in range(8)]
    console = FakeConsole()
    router = LogRouter(logs, console, log_ranks=[0])  # type: ignore[arg-type]
    for r in range(8):
        router.feed(8 + r, STDERR, b"INFO | [GPU %d] chatter\n" % r + WARNING % r + b"\n", 0.0)
    router.close()
    assert console.lines == [b"n1/GPU[0-7]:WARNING | [GPU *] the dataloader is 2x slower than the step"]


def test_what_is_held_is_bounded_and_printed_when_the_attempt_ends():
    g = _sources(2)
    folder = LineFolder(g, gap=0.2, longest=1.0, max_held=1000)
    for i in range(50):  # 50 distinct 100-byte lines at once: more than 1000 bytes may wait
        folder.add(1, g[0], b"%03d" % i + b"x" * 97, 0.0)
    early = folder.due(0.0)
    assert len(early) >= 40 and early[0][1].startswith(b"GPU0:000")
    assert len(early) + len(folder.due(0.0, everything=True)) == 50


def test_a_real_run_folds_a_warning_from_every_rank(tmp_path):
    script = tmp_path / "warn.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "rank = os.environ['RANK']\n"
        "pathlib.Path(f'up{rank}').touch()  # a barrier, as the collective before a warning would be\n"
        "while len(list(pathlib.Path().glob('up*'))) < 4:\n"
        "    time.sleep(0.005)\n"
        "print(f'WARNING | [CPU {rank}] the dataloader is slow', file=sys.stderr, flush=True)\n"
        "print(f'INFO | [CPU {rank}] Step [0/1] | Loss: 1.0000', file=sys.stderr, flush=True)\n")
    r = sh.run(tmp_path, args=("--nproc", "4"), script=script)
    assert r.code == 0, r.err
    err = r.err.splitlines()
    assert err.count("CPU[0-3]:WARNING | [CPU *] the dataloader is slow") == 1, r.err
    assert not [line for line in err if line.startswith("CPU") and "dataloader" in line and "[0-3]" not in line]
    assert sum(f"CPU{k}:INFO | [CPU {k}] Step [0/1]" in r.err for k in range(4)) == 4  # every rank's step line
    for k in range(4):
        assert f"CPU{k}:WARNING | [CPU {k}] the dataloader is slow\n" in r.log(k)


def test_python_warnings_fold_with_their_source_line(tmp_path):
    """`warnings.warn` prints two lines per rank; both fold, in order."""
    logs = [WorkerLog(r, f"CPU{r}", tmp_path / f"w{r}.log") for r in range(3)]
    console = FakeConsole()
    router = LogRouter(logs, console)  # type: ignore[arg-type]
    for r in range(3):
        router.feed(r, STDERR, b"/x/train.py:12: UserWarning: TF32 is off\n  warnings.warn(\n", 0.0)
    router.close()
    assert console.lines == [b"CPU[0-2]:/x/train.py:12: UserWarning: TF32 is off", b"CPU[0-2]:  warnings.warn("]


def test_a_flood_is_printed_as_it_comes_after_what_was_held(tmp_path):
    logs = [WorkerLog(r, f"CPU{r}", tmp_path / f"w{r}.log") for r in range(2)]
    console = FakeConsole()
    router = LogRouter(logs, console)  # type: ignore[arg-type]
    router.feed(1, STDERR, b"held for its twin\n", 0.0)
    flood = b"".join(b"line %d\n" % i for i in range(FLOOD_LINES + 1))
    router.feed(0, STDERR, flood, 0.01)  # one read of hundreds of lines: no per-line folding
    assert console.lines == [b"CPU1:held for its twin"] + [b"CPU0:line %d" % i for i in range(FLOOD_LINES + 1)]
    router.close()
