"""worker/script_bootstrap.py: a script run through it sees what Python would show it, and its
optimizer steps become heartbeats without a line of gpuherd code in it."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest

from gpuherd.status_channel import StatusWriter
from worker import script_bootstrap
from gpuherd.status_records import LiveWarm, decode
from worker.script_bootstrap import AFTER_SAVE_S, HEARTBEAT_EVERY, AfterImport, Heartbeat, SaveShield, WarmWord

BOOTSTRAP_SELF = Path(script_bootstrap.__file__)

SHOW = """\
import json, sys
import helper
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "file": __file__, "name": __name__,
                  "spec": __spec__ and [__spec__.name, __spec__.origin], "loader": type(__loader__).__name__,
                  "cached": __cached__,
                  "main": sys.modules["__main__"].__dict__ is globals(), "helper": helper.WHERE,
                  "torch": "torch" in sys.modules}))
"""
RAISE = "def inner():\n    raise ValueError('boom')\n\ninner()\n"


def _python(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = env or {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-u", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user project: a script beside a module of its own, run through a symlink from elsewhere."""
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "helper.py").write_text("WHERE = 'src'\n")
    (src / "show.py").write_text(SHOW)
    (src / "pkg" / "__init__.py").write_text("")
    (src / "pkg" / "show.py").write_text(SHOW)
    (src / "fail.py").write_text(RAISE)
    (tmp_path / "link.py").symlink_to(src / "show.py")
    return tmp_path


@pytest.mark.parametrize("target", [["src/show.py", "a", "--b"], ["link.py", "x"]])
def test_a_script_sees_argv_sys_path_and_file_as_under_python(project, target):
    plain, ours = _python(target, project), _python([str(BOOTSTRAP_SELF), *target], project)
    assert plain.returncode == ours.returncode == 0, ours.stderr
    assert orjson.loads(ours.stdout) == orjson.loads(plain.stdout)
    assert orjson.loads(ours.stdout)["path0"] == str(project / "src")  # the symlink's target directory


def test_a_module_sees_what_python_dash_m_shows(project):
    plain = _python(["-m", "pkg.show", "c"], project / "src")
    ours = _python([str(BOOTSTRAP_SELF), "-m", "pkg.show", "c"], project / "src")
    assert plain.returncode == ours.returncode == 0, ours.stderr
    assert orjson.loads(ours.stdout) == orjson.loads(plain.stdout)


def test_a_failing_script_prints_pythons_traceback_and_exit_code(project):
    plain, ours = _python(["src/fail.py"], project), _python([str(BOOTSTRAP_SELF), "src/fail.py"], project)
    assert plain.returncode == ours.returncode == 1
    assert ours.stderr == plain.stderr  # no frame of the bootstrap in it
    (project / "src" / "exit3.py").write_text("raise SystemExit(3)\n")
    assert _python([str(BOOTSTRAP_SELF), "src/exit3.py"], project).returncode == 3


ENV_SHOW = """\
import json, os, sys
print(json.dumps({"torch": "torch" in sys.modules, "dynamo": "torch._dynamo" in sys.modules,
                  "env": {k: os.environ.get(k) for k in ("RANK", "GPUHERD_STANDBY", "MARK", "GPUHERD_STATUS_FD")},
                  "argv": sys.argv, "path0": sys.path[0]}))
"""


def _standby(project: Path, stdin: bytes) -> subprocess.CompletedProcess:
    (project / "src" / "env_show.py").write_text(ENV_SHOW)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "GPUHERD_STANDBY": "1", "RANK": "0",
           "MARK": "before", "GPUHERD_STATUS_FD": "7"}
    return subprocess.run([sys.executable, "-u", str(BOOTSTRAP_SELF), "src/env_show.py", "a"], cwd=project, env=env,
                          input=stdin, capture_output=True, timeout=120)


def test_a_standby_imports_torch_then_runs_the_script_with_the_environment_it_is_handed(project):
    handed = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"RANK": "3", "MARK": "after"}
    done = _standby(project, orjson.dumps({"env": handed}) + b"\n")
    assert done.returncode == 0, done.stderr
    seen = orjson.loads(done.stdout)
    assert seen["torch"] and seen["dynamo"]  # imported before the script started
    # the handed environment, with the standby's own status fd; the standby marker is gone
    assert seen["env"] == {"RANK": "3", "GPUHERD_STANDBY": None, "MARK": "after", "GPUHERD_STATUS_FD": "7"}
    assert seen["argv"] == ["src/env_show.py", "a"] and seen["path0"] == str(project / "src")


def test_a_standby_told_it_is_not_needed_exits_0_without_running_the_script(project):
    done = _standby(project, b"")
    assert done.returncode == 0 and done.stdout == b"" and done.stderr == b""


def test_a_live_spare_says_warm_once_torch_is_imported_but_never_once_it_holds_a_rank():
    """A script's warm spare (GPUHERD_SPARE=1) tells its pool it is warm, as the trainer's spare does
    (the straggler move-out takes only a warm one); the word is never said on a channel that is a
    rank's already, nor by a restart standby (no GPUHERD_SPARE: fd None)."""
    read, write = os.pipe()
    try:
        WarmWord(str(write)).say()
        promoted = WarmWord(str(write))
        promoted.promoted()  # handed a rank mid-import: its channel is the rank's
        promoted.say()
        WarmWord(None).say()
    finally:
        os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = [decode(line) for line in pipe.read().splitlines()]
    assert len(said) == 1 and isinstance(said[0], LiveWarm)


def _bootstrapped(script: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`script` run through the bootstrap with a status pipe, in its directory: its exit and its records."""
    read, write = os.pipe()
    env = {**env, "GPUHERD_STATUS_FD": str(write), "RANK": "0"}
    proc = subprocess.run([sys.executable, "-u", str(BOOTSTRAP_SELF), str(script)], cwd=script.parent, env=env,
                          pass_fds=(write,), capture_output=True, text=True, timeout=120)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        records = [orjson.loads(line) for line in pipe.read().splitlines()]
    assert proc.returncode == 0, proc.stderr
    return proc, records


@pytest.mark.parametrize("without_orjson", [False, True])
def test_optimizer_steps_and_torch_save_become_status_records(tmp_path, without_orjson):
    """A real torch script with nothing of gpuherd in it, through the bootstrap with a status pipe;
    also in an interpreter that has torch but not orjson (torchrun's PYTHON_EXEC, say)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(5):\n"
        "    opt.zero_grad(); model(torch.ones(1, 2)).sum().backward(); opt.step()\n"
        "torch.save(model.state_dict(), 'model.pt')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if without_orjson:  # an import of orjson fails there as in an interpreter that lacks it
        (tmp_path / "blocked").mkdir()
        (tmp_path / "blocked" / "orjson.py").write_text("raise ModuleNotFoundError(\"No module named 'orjson'\")\n")
        env["PYTHONPATH"] = str(tmp_path / "blocked")
    proc, records = _bootstrapped(script, env)
    seen = [(r["type"], r.get("step", r.get("name"))) for r in records]
    # the first step at once, the save as phase checkpoint and what it wrote, the real last step and the teardown
    assert seen == [("step", 1), ("phase", "checkpoint"), ("script_save", 5), ("phase", "train"), ("step", 5),
                    ("phase", "shutdown")]
    save = next(r for r in records if r["type"] == "script_save")
    assert save["path"] == str(tmp_path / "model.pt") and save["api"] == "torch.save" and save["seconds"] >= 0
    assert (tmp_path / "model.pt").is_file() and "WARNING" not in proc.stderr


def test_a_torch_without_the_optimizer_hook_runs_the_script_after_one_warning(tmp_path):
    """torch < 2.0 (no global optimizer-step hook): the script runs, unwatched, and says so once."""
    fake = tmp_path / "fake" / "torch"
    (fake / "optim").mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '1.13.1'\nsave = None\n")
    (fake / "optim" / "__init__.py").write_text("")
    (fake / "optim" / "optimizer.py").write_text("")  # no register_optimizer_step_post_hook
    script = tmp_path / "train.py"
    script.write_text("import torch\nprint('ran with torch', torch.__version__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path / "fake")
    proc = _python([str(BOOTSTRAP_SELF), str(script)], tmp_path, env)
    assert proc.returncode == 0 and proc.stdout == "ran with torch 1.13.1\n", proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "no automatic heartbeats" in warnings[0], proc.stderr


LAST_BACKWARD = """\
import atexit, functools
# Registered first, so it runs last: the interpreter's last act before it finalizes holds the
# GIL in C (no bytecode runs, so it is never handed over) for longer than the collective runs.
atexit.register(functools.partial(sum, range(30_000_000)))
import os, tempfile
import torch
import torch.distributed as dist

store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", rank=0, world_size=1, store=store)
chunks = [torch.ones(1 << 20) for _ in range(8)]


def reduce_in_backward(grad):
    dist.group.WORLD.allreduce(chunks)  # as a DDP communication hook does; nobody waits for it
    return grad


weight = torch.ones(4, requires_grad=True)
weight.register_hook(reduce_in_backward)
(weight * 2).sum().backward()
print("script done", flush=True)
"""


def test_gloos_worker_gets_the_gil_it_needs_before_the_interpreter_finalizes(tmp_path):
    """gloo's worker thread must take the GIL to drop the collective it completed; here it can
    only ask while the interpreter is about to finalize. Under plain `python` (and torchrun)
    this script dies of SIGABRT at exit, "terminate called without an active exception"
    (gpuherd/gloo_exit.py); through the bootstrap it exits 0."""
    (tmp_path / "last_backward.py").write_text(LAST_BACKWARD)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-u", str(BOOTSTRAP_SELF), "last_backward.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "script done\n" and "terminate called" not in proc.stderr


def test_a_script_without_torch_never_imports_it_and_sends_nothing(project):
    read, write = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(GPUHERD_STATUS_FD=str(write), RANK="0")
    proc = subprocess.run([sys.executable, "-u", str(BOOTSTRAP_SELF), "src/show.py"], cwd=project, env=env,
                          pass_fds=(write,), capture_output=True, text=True, timeout=60)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        assert pipe.read() == b""
    assert proc.returncode == 0 and orjson.loads(proc.stdout)["torch"] is False


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def channel(monkeypatch):
    monkeypatch.setattr(StatusWriter, "explicit_records", False)
    monkeypatch.setattr(StatusWriter, "explicit_steps", False)
    read, write = os.pipe()
    os.set_blocking(read, False)

    def records() -> list[tuple[str, object]]:
        try:
            data = os.read(read, 1 << 16)
        except BlockingIOError:
            return []
        return [(r["type"], r.get("step", r.get("name"))) for r in map(orjson.loads, data.splitlines())]

    yield StatusWriter(write, 0, automatic=True), records
    os.close(read)
    os.close(write)


def test_steps_are_rate_limited_and_saves_announced_only_after_the_first_step(channel):
    writer, records = channel
    clock = FakeClock()
    beat = Heartbeat(writer, clock)
    save = beat.saving(lambda: "saved")
    assert save() == "saved" and records() == []  # nothing before the first optimizer step
    for _ in range(3):
        beat.on_step(None, (), {})
    assert records() == [("step", 1)]
    clock.now += HEARTBEAT_EVERY
    beat.on_step(None, (), {})
    assert records() == [("step", 4)]
    assert save() == "saved" and records() == [("phase", "checkpoint"), ("script_save", 4), ("phase", "train")]
    beat.on_step(None, (), {})
    beat.at_exit()
    assert records() == [("step", 5), ("phase", "shutdown")]


def test_a_script_that_reports_for_itself_silences_the_automatic_heartbeat(channel):
    writer, records = channel
    beat = Heartbeat(writer, FakeClock())
    with open(os.devnull, "wb") as elsewhere:
        StatusWriter(elsewhere.fileno(), 0).send("step", step=7)  # the script's own writer
    beat.on_step(None, (), {})
    beat.at_exit()
    assert records() == []


def test_a_script_whose_steps_gpuherd_live_numbers_gets_no_second_numbering_but_keeps_its_phases(channel):
    """gpuherd.live sends the script's `step` records (the loop's own step numbers); the heartbeat's
    count of optimizer steps would be a second numbering. Its phases (checkpoint, shutdown) stay."""
    writer, records = channel
    beat = Heartbeat(writer, FakeClock())
    StatusWriter.explicit_steps = True
    beat.on_step(None, (), {})
    beat.saving(lambda: None)()
    beat.at_exit()
    assert records() == [("phase", "checkpoint"), ("script_save", 1), ("phase", "train"), ("phase", "shutdown")]


def test_after_import_calls_back_once_the_module_is_imported(tmp_path, monkeypatch):
    (tmp_path / "lazy_mod_for_test.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_mod_for_test", raising=False)
    seen = []
    hook = AfterImport("lazy_mod_for_test", lambda module: seen.append(module.VALUE))
    hook.install()
    try:
        assert seen == [] and hook in sys.meta_path
        import lazy_mod_for_test  # noqa: F401
        assert seen == [42] and hook not in sys.meta_path
        AfterImport("lazy_mod_for_test", lambda module: seen.append("already")).install()
        assert seen == [42, "already"]
    finally:
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)
        sys.modules.pop("lazy_mod_for_test", None)


def _fake_torch(root: Path, save: str) -> Path:
    """A torch package with the optimizer-step hook and `save` as given (no real torch: quick)."""
    fake = root / "fake" / "torch"
    (fake / "optim").mkdir(parents=True)
    (fake / "__init__.py").write_text("import os, signal, time\n" + save)
    (fake / "optim" / "__init__.py").write_text("")
    (fake / "optim" / "optimizer.py").write_text("def register_optimizer_step_post_hook(hook):\n    pass\n")
    return root / "fake"


def test_a_sigterm_during_torch_save_lands_after_the_save_and_its_rename(tmp_path):
    """The teardown's SIGTERM comes while rank 0 writes its checkpoint: the save and the script's
    rename complete, then the rank dies of SIGTERM (the script went on into a wait that never ends)."""
    fake = _fake_torch(tmp_path, "def save(obj, path):\n"
                                 "    os.kill(os.getpid(), signal.SIGTERM)\n"
                                 "    time.sleep(0.3)\n"
                                 "    open(path, 'w').write(obj)\n")
    script = tmp_path / "train.py"
    script.write_text("import os, time, torch\n"
                      "torch.save('weights', 'ckpt.tmp')\n"
                      "os.replace('ckpt.tmp', 'ckpt')\n"
                      "time.sleep(60)\n"
                      "print('the SIGTERM never landed')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(fake), RANK="0")
    began = time.monotonic()
    proc = _python([str(BOOTSTRAP_SELF), str(script)], tmp_path, env)
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert (tmp_path / "ckpt").read_text() == "weights"
    assert time.monotonic() - began < 30  # the held signal landed, AFTER_SAVE_S after the save


def _installed(signum: int = signal.SIGTERM):
    return signal.getsignal(signum)


def test_the_held_sigterm_lands_at_the_next_optimizer_step_or_after_the_save(channel):
    writer, _ = channel
    died = []
    shield = SaveShield(die=lambda: died.append(time.monotonic()), after_s=60)
    beat = Heartbeat(writer, FakeClock(), shield=shield)

    def save_interrupted() -> str:
        assert _installed() == shield._hold  # noqa: SLF001 - the handler in place during the save
        _installed()(signal.SIGTERM, None)  # the SIGTERM arrives now
        return "saved"

    assert beat.saving(save_interrupted)() == "saved" and died == []
    assert _installed() is signal.SIG_DFL  # the script's default is back once the save ended
    beat.on_step(None, (), {})
    assert len(died) == 1  # the script stepped on: past its save and its rename
    assert beat.saving(lambda: "saved")() == "saved" and _installed() is signal.SIG_DFL

    quick = SaveShield(die=lambda: died.append(time.monotonic()), after_s=0.05)
    assert quick.enter()
    _installed()(signal.SIGTERM, None)
    quick.leave()
    deadline = time.monotonic() + 10
    while len(died) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(died) == 2  # no step came (a collective its dead peer never joins): the timer landed it
    assert AFTER_SAVE_S <= 5  # the rank goes well within the supervisor's default grace period


def test_a_save_during_the_wait_holds_the_signal_to_its_end():
    died = []
    shield = SaveShield(die=lambda: died.append(1), after_s=60)
    assert shield.enter()
    _installed()(signal.SIGTERM, None)
    shield.leave()
    assert shield.enter()  # a second file of the same checkpoint
    shield.release()  # the timer fires meanwhile: not yet
    assert died == []
    shield.leave()
    shield.release()
    assert died == [1] and _installed() is signal.SIG_DFL


def test_a_scripts_own_sigterm_handler_and_a_saving_thread_are_left_alone():
    def mine(_signum, _frame):
        pass

    shield = SaveShield(die=lambda: None)
    previous = signal.signal(signal.SIGTERM, mine)
    try:
        assert not shield.enter() and _installed() is mine  # the script's handler is the script's business
    finally:
        signal.signal(signal.SIGTERM, previous)
    entered = []
    thread = threading.Thread(target=lambda: entered.append(shield.enter()))
    thread.start()
    thread.join()
    assert entered == [False] and _installed() is signal.SIG_DFL  # a handler can only be installed from main


def test_a_save_names_the_file_it_wrote_and_a_failed_save_is_no_save(channel, tmp_path):
    """torch.save(obj, f): a path, a PathLike, an open file by its name; a buffer has no path (Lightning
    writes through one); a save that raised is not reported as one."""
    writer, _ = channel
    beat = Heartbeat(writer, FakeClock())
    beat.on_step(None, (), {})
    paths = []

    def save(obj, f):
        if f == "refused":
            raise OSError("disk full")

    sent: list[dict] = []
    writer.send = lambda type_, **fields: sent.append({"type": type_, **fields})  # type: ignore[method-assign]
    wrapped = beat.saving(save)
    with open(tmp_path / "open.pt", "wb") as opened:
        for f in ("rel.pt", tmp_path / "p.pt", opened, io.BytesIO()):
            wrapped({}, f)
            paths.append(sent[-2]["path"])
    assert paths == [str(Path("rel.pt").absolute()), str(tmp_path / "p.pt"), str(tmp_path / "open.pt"), None]
    with pytest.raises(OSError):
        wrapped({}, "refused")
    assert [r["type"] for r in sent[-2:]] == ["phase", "phase"]  # checkpoint, train: and no script_save


def test_a_dcp_save_is_watched_as_torch_save_is(tmp_path):
    """torch.distributed.checkpoint.save in a real script: phase checkpoint, then its checkpoint_id."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "import torch.distributed.checkpoint as dcp\n"
        "model = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    opt.zero_grad(); model(torch.ones(1, 2)).sum().backward(); opt.step()\n"
        "dcp.save({'model': model.state_dict()}, checkpoint_id='ckpt-3')\n")
    proc, records = _bootstrapped(script, {k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    saves = [r for r in records if r["type"] == "script_save"]
    assert [(r["api"], r["step"], r["path"]) for r in saves] == [("dcp.save", 3, str(tmp_path / "ckpt-3"))]
    assert (tmp_path / "ckpt-3" / ".metadata").is_file()
