"""Run a user's script exactly as Python would, with hang detection that needs no code in it.

    python -u .../worker/script_bootstrap.py SCRIPT ARGS...      = python -u SCRIPT ARGS...
    python -u .../worker/script_bootstrap.py -m MODULE ARGS...   = python -u -m MODULE ARGS...

What `gpuherd run train.py` starts on every rank (not with `--no-auto-heartbeat`). It is
started by path, never with `-m` or a PYTHONPATH entry, so nothing of gpuherd lands on the
script's sys.path: a user package named `worker` or `supervisor` is the user's. The script
then sees `sys.argv`, `sys.path[0]`, `__file__`, `__name__ == "__main__"` as under Python.

Heartbeats: once the script has imported torch, every optimizer step (torch's global
optimizer-step post hook) becomes a `step` status record, at most every HEARTBEAT_EVERY s,
and `torch.save` (and `torch.distributed.checkpoint.save`) runs in phase `checkpoint` (the
supervisor gives a saving rank the long allowance); the interpreter's teardown once the
script returned runs in phase `shutdown`. A save that returned becomes a `script_save` record
(the steps done, the path, how long): what the supervisor says of the script's saves after a
failure or a stop, and what goodput counts as kept. A SIGTERM that lands inside torch.save
waits for the save (`SaveShield`).
Nothing is sent before the first optimizer step: a script that never steps one
is not judged by heartbeat, and the supervisor says so. A script that writes its own status
records (gpuherd.status_channel) takes over; the automatic ones stop. SIGUSR1 dumps every
thread's Python stack (faulthandler), as for the built-in worker. Last, before the
interpreter finalizes, gloo's worker threads get the GIL they still need
(gpuherd/gloo_exit.py: else a rank may die of SIGABRT after a finished run).

It runs in the script's interpreter (torchrun's PYTHON_EXEC), which may have torch and
nothing of gpuherd's dependencies: what it imports needs only the standard library, and
where the heartbeat cannot work there (gpuherd's modules do not import, a torch without the
optimizer-step hook) the script runs all the same, after one WARNING line on stderr.
"""

from __future__ import annotations

import atexit
import builtins
import faulthandler
import functools
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import runpy
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

HEARTBEAT_EVERY = 0.5  # seconds between step records: well under any sensible --hang-timeout
STANDBY = "GPUHERD_STANDBY"  # gpuherd/contract.py's name (nothing of gpuherd's is imported this early)
SPARE = "GPUHERD_SPARE"  # ... and this: a live recovery's warm spare (a restart standby has none)
STATUS_FD = "GPUHERD_STATUS_FD"
SPARE_SOURCE_FD = "GPUHERD_SPARE_SOURCE_FD"  # a script's spare source (worker/spare_fork.py)
LIVE_RECOVERY = "GPUHERD_LIVE_RECOVERY"
SPARE_WARM_UP_NICE = "GPUHERD_SPARE_WARM_UP_NICE"  # "0": a shrunk group waits for this spare's import
STANDBY_NICE = 19  # the standby's import yields to every training rank
# What a torchrun-style script's start imports, in the order it does: torch, its process group, and
# torch._dynamo, which DistributedDataParallel's constructor (and FSDP's, and torch.compile) imports
# lazily: 1.4 s of a 2-core CPU, more than torch itself.
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")
DCP = "torch.distributed.checkpoint"  # its blocking save is watched as torch.save is
AFTER_SAVE_S = 1.0  # a SIGTERM held through torch.save lands at most this long after it: the script's rename


def _die_of_sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class SaveShield:
    """A SIGTERM that lands while the script is inside torch.save waits for the save to end.

    Python's default is to die at once: the file is left half-written (a script that writes a
    temporary file and renames it never renames it), and after the restart every rank redoes
    the steps since the previous checkpoint. The supervisor's teardown after another rank
    failed is such a SIGTERM, and it comes fast, to a rank 0 that may be writing the checkpoint
    its peers' all-reduce already paid for. The held signal lands at the script's next
    optimizer step (its rename is done by then), AFTER_SAVE_S after the save (a rank that went
    on into a collective its dead peer never joins) or at the script's exit, whichever comes
    first, and the process dies of SIGTERM as it would have; the supervisor's SIGKILL after
    its grace period still bounds it all. Only where the script left SIGTERM at its default and
    saves from the main thread (the one place a handler can be installed): a script's own
    handler is the script's business."""

    def __init__(self, die: Callable[[], None] = _die_of_sigterm, after_s: float = AFTER_SAVE_S) -> None:
        self.die, self.after_s = die, after_s
        self.depth = 0  # saves in progress (a save inside a save is one)
        self.held = False  # a SIGTERM came during a save and has not landed yet
        self._timer: threading.Timer | None = None

    def enter(self) -> bool:
        """A save begins; True: it is shielded (`leave` after it)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if self.depth == 0:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return False
            signal.signal(signal.SIGTERM, self._hold)
        self.depth += 1
        return True

    def leave(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if self.held:  # the latest save ended: the rename after it gets its moment
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = threading.Timer(self.after_s, self.release)
                self._timer.daemon = True
                self._timer.start()

    def release(self) -> None:
        """The held SIGTERM lands now, unless a save is in progress again (held on to its end)."""
        if self.held and self.depth == 0:
            self.die()

    def _hold(self, _signum: int, _frame: object) -> None:
        self.held = True


class Heartbeat:
    """Optimizer steps -> `step` records; torch.save -> phase `checkpoint`."""

    def __init__(self, writer: Any, clock: Callable[[], float] = time.monotonic,
                 shield: SaveShield | None = None) -> None:
        self.writer = writer  # a gpuherd.status_channel.StatusWriter(automatic=True)
        self.clock = clock
        self.shield = shield or SaveShield()
        self.steps = 0
        self.sent = 0  # the step count last reported
        self.saves_open = 0  # saves in progress: one inside another (dcp.save's own torch.save) is part of it
        self.last_sent = 0.0

    def _quiet(self) -> bool:
        return type(self.writer).explicit_records  # the script reports for itself

    def on_step(self, _optimizer: object, _args: object, _kwargs: object) -> None:
        self.shield.release()  # a SIGTERM held through a save: the script is past its save
        self.steps += 1
        now = self.clock()
        if self.sent == 0 or now - self.last_sent >= HEARTBEAT_EVERY:
            self._send(now)

    def _send(self, now: float) -> None:
        if not self._quiet() and not type(self.writer).explicit_steps:  # gpuherd.live numbers them itself
            self.writer.send("step", step=self.steps)
            self.sent, self.last_sent = self.steps, now

    def at_exit(self) -> None:
        """The script is done: the supervisor's last step for this rank is the real one, and the
        interpreter's teardown (process groups, CUDA, garbage) may take a while: phase shutdown."""
        self.shield.release()
        if self.steps > self.sent:
            self._send(self.clock())
        if self.steps and not self._quiet():
            self.writer.send("phase", name="shutdown")

    def saving(self, save: Callable[..., Any], api: str = "torch.save",
               where: Callable[[tuple, dict], str | None] | None = None) -> Callable[..., Any]:
        """`save` in phase `checkpoint`, and once it returned a `script_save` record: the steps
        done, the path (`where(args, kwargs)`; default: torch.save's file argument) and how long."""
        where = where or torch_save_path

        @functools.wraps(save)
        def save_in_phase_checkpoint(*args: Any, **kwargs: Any) -> Any:
            # silent until the first step; a save inside a save (dcp.save's own torch.save) is the outer one's
            announce = self.steps > 0 and not self._quiet() and self.saves_open == 0
            if announce:
                self.writer.send("phase", name="checkpoint")
            shielded = self.shield.enter()
            began, saved = self.clock(), False
            self.saves_open += 1
            try:
                result = save(*args, **kwargs)
                saved = True
                return result
            finally:
                self.saves_open -= 1
                if shielded:
                    self.shield.leave()
                if announce and saved:
                    self.writer.send("script_save", step=self.steps, path=_quietly(where, args, kwargs), api=api,
                                     seconds=round(self.clock() - began, 4))
                if announce:
                    self.writer.send("phase", name="train")
        return save_in_phase_checkpoint

    def attach(self, torch: types.ModuleType) -> None:
        """Right after `import torch` completed in the script."""
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except ImportError:  # torch < 2.0 has no global optimizer hook
            _warn(f"torch {getattr(torch, '__version__', '?')} has no optimizer-step hook: no automatic "
                  "heartbeats from this rank (hang detection needs torch >= 2.0 or status records)")
            return
        register_optimizer_step_post_hook(self.on_step)
        torch.save = self.saving(torch.save)
        AfterImport(DCP, self.attach_dcp).install()
        atexit.register(self.at_exit)

    def attach_dcp(self, dcp: types.ModuleType) -> None:
        """Right after the script imported torch.distributed.checkpoint: its blocking `save`
        (`dcp.save(...)`, looked up at each call) is a save as torch.save is."""
        if callable(getattr(dcp, "save", None)):
            dcp.save = self.saving(dcp.save, api="dcp.save", where=dcp_save_path)


def torch_save_path(args: tuple, kwargs: dict) -> str | None:
    """The file torch.save(obj, f) wrote: a path, or a file object's name; None for a buffer."""
    f = args[1] if len(args) > 1 else kwargs.get("f")
    if isinstance(f, (str, os.PathLike)):
        return os.path.abspath(os.fsdecode(f))
    name = getattr(f, "name", None)  # an open file; a BytesIO has none (Lightning writes through one)
    return os.path.abspath(name) if isinstance(name, str) else None


def dcp_save_path(args: tuple, kwargs: dict) -> str | None:
    """Where dcp.save(state_dict, checkpoint_id=..., storage_writer=...) wrote: its checkpoint_id,
    else its storage writer's path."""
    target = kwargs.get("checkpoint_id")
    if target is None:
        target = getattr(kwargs.get("storage_writer"), "path", None)
    if isinstance(target, (str, os.PathLike)):
        text = os.fsdecode(target)
        return text if "://" in text else os.path.abspath(text)
    return None


def _quietly(where: Callable[[tuple, dict], str | None], args: tuple, kwargs: dict) -> str | None:
    try:
        return where(args, kwargs)
    except Exception:  # noqa: BLE001 - an odd argument never breaks the script's save
        return None


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once the script imported `name`, without importing it ourselves
    (a script that never imports torch pays nothing for it)."""

    def __init__(self, name: str, then: Callable[[types.ModuleType], None]) -> None:
        self.name, self.then = name, then

    def install(self) -> None:
        if self.name in sys.modules:
            self.then(sys.modules[self.name])
        else:
            sys.meta_path.insert(0, self)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; the other finders locate the module
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """`loader`, plus a call once the module has run. A wrapper, not a patched loader: one
    loader object may load many modules (pytest's assertion rewriter does)."""

    def __init__(self, loader: Any, then: Callable[[types.ModuleType], None]) -> None:
        self.loader, self.then = loader, then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        module.__spec__.loader = module.__loader__ = self.loader  # the module keeps its own loader
        self.then(module)

    def __getattr__(self, name: str) -> Any:  # get_code, get_resource_reader, ...: the loader's own
        return getattr(self.loader, name)


def run_script(script: str, args: list[str]) -> None:
    """What `python SCRIPT ARGS` does: argv as typed, sys.path[0] the script's real directory,
    `__file__` absolute. (runpy.run_path would set argv[0] and __file__ to one string.)"""
    path = os.path.abspath(script)
    with open(path, "rb") as f:  # noqa: PTH123 - the bytes Python itself would compile
        code = compile(f.read(), path, "exec", dont_inherit=True)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __spec__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    exec(code, main.__dict__)  # noqa: S102 - running the user's script is the point


def run_module(module: str, args: list[str]) -> None:
    """What `python -m MODULE ARGS` does: sys.path[0] is the working directory."""
    sys.argv = ["-m", *args]
    sys.path[0] = os.getcwd()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _user_frames_only(exc: BaseException) -> types.TracebackType | None:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _settle_gloo_threads(settle: Callable[[], bool], limit_s: float) -> None:
    """gloo's worker threads release what needs the GIL while the interpreter can still give it."""
    if not settle():
        print(f"gpuherd: gloo's worker threads were still busy {limit_s:g} s after the script ended; "
              "the interpreter finalizes anyway", file=sys.stderr)


def _warn(message: str) -> None:
    print(f"WARNING | gpuherd: {message}", file=sys.stderr, flush=True)


def _watch(rank: int) -> None:
    """Heartbeats and the gloo exit fix, where this interpreter can import gpuherd's modules."""
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # gpuherd's packages, briefly
    try:
        from gpuherd.gloo_exit import LIMIT_S, settle
        from gpuherd.status_channel import StatusWriter
    except Exception as exc:  # noqa: BLE001 - an old Python, a broken install: the script runs regardless
        _warn(f"{sys.executable} cannot run gpuherd's heartbeat ({type(exc).__name__}: {exc}): "
              "this rank is not watched for hangs")
        return
    # Registered before the script runs, so it runs after every atexit callback of the script
    # and of torch, right before the interpreter finalizes (gpuherd/gloo_exit.py: why).
    atexit.register(_settle_gloo_threads, settle, LIMIT_S)
    heartbeat = Heartbeat(StatusWriter.from_env(rank, automatic=True))
    then = heartbeat.attach
    if os.environ.get(LIVE_RECOVERY) == "1":
        then = _with_live_hooks(then)
    AfterImport("torch", then).install()


def _with_live_hooks(attach: Callable[[types.ModuleType], None]) -> Callable[[types.ModuleType], None]:
    """`attach`, then gpuherd.live's hooks (gpuherd/live/hooks.py: before the script makes its
    process group and DDP wrapper, whatever the order of its imports). Its module is imported now,
    while gpuherd's packages are first on sys.path; it imports torch only once the script has."""
    try:
        from gpuherd.live import hooks
    except Exception as exc:  # noqa: BLE001 - the script runs regardless; a lost rank then restarts everyone
        _warn(f"gpuherd.live cannot be imported here ({type(exc).__name__}: {exc}): no live recovery")
        return attach

    def then(torch: types.ModuleType) -> None:
        attach(torch)
        try:
            hooks.install()
        except Exception as exc:  # noqa: BLE001 - as above: the script's import of torch must not fail
            _warn(f"gpuherd.live's hooks not installed ({type(exc).__name__}: {exc}): no live recovery")
    return then


class WarmWord:
    """A live recovery's warm spare of a script (GPUHERD_SPARE=1, supervisor/processes/live_setup.py)
    says `live`/`warm` on its status channel once its import of torch is over, as the built-in
    trainer's spare does (worker/spare.py): the straggler move-out takes only a warm spare
    (supervisor/processes/straggler_out.py). Never once it was handed a rank: the channel is the
    rank's from then on. A restart standby (no GPUHERD_SPARE) says nothing."""

    def __init__(self, fd: str | None) -> None:
        self.fd = int(fd) if fd else None
        self._lock = threading.Lock()

    def say(self) -> None:
        with self._lock:
            if self.fd is None:
                return
            line = json.dumps({"type": "live", "event": "warm", "rank": 0, "time": time.time()}) + "\n"
            try:
                os.write(self.fd, line.encode())
            except OSError:
                pass
            self.fd = None

    def promoted(self) -> None:
        with self._lock:
            self.fd = None


def _spare_fork() -> types.ModuleType:
    """worker/spare_fork.py, beside this file, loaded by path (nothing of gpuherd's on sys.path)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spare_fork.py")
    spec = importlib.util.spec_from_file_location("gpuherd_spare_fork", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _preload(done_fd: int = -1) -> bool:
    """The standby's import of torch, at the lowest priority (Linux nice is per thread, so the
    main thread keeps its own). Against the training ranks, each a session of its own, it is the
    supervisor's choice of when to start the standby that counts (autogroups share the CPU by
    session): once the attempt has stepped (supervisor/processes/standbys.py); a spare a shrunk
    group waits for imports at the ranks' priority (SPARE_WARM_UP_NICE). False: it failed."""
    said = os.environ.get(SPARE_WARM_UP_NICE, "")
    with_nice(int(said) if said.isdigit() and int(said) <= STANDBY_NICE else STANDBY_NICE)
    try:
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001 - the script's own import of it says what is wrong
                return False
        # What was imported lives as long as the process: out of the collector's way, so the script's
        # collections do not walk torch's objects again and again (as the built-in worker, worker/heap.py).
        gc.collect()
        gc.freeze()
        return True
    finally:
        if done_fd >= 0:  # a spare source serves forks from now on (worker/spare_fork.py)
            try:
                os.write(done_fd, b"w")
            except OSError:  # it was handed a rank before: nobody reads this any more
                pass
            os.close(done_fd)


def with_nice(nice: int, tid: int | None = None) -> bool:
    """Set thread `tid`'s (this thread's) nice value; False where it is not allowed (a lower
    value than it has needs CAP_SYS_NICE or RLIMIT_NICE)."""
    try:
        os.setpriority(os.PRIO_PROCESS, tid if tid is not None else threading.get_native_id(), nice)
        return True
    except (OSError, AttributeError):
        return False


def stand_by(argv: list[str], stdin: Any = None) -> bool:
    """A restart standby (supervisor/processes/standbys.py): import torch while the attempt before
    trains, then wait for this rank's environment on stdin (one JSON line, `{"env": {...}}`) and
    take it as the script's (its status fd kept). False: end of input, the standby is not needed.
    The script starts only once the import is over: its own `import torch` would wait for it
    anyway, and the heartbeat hooks torch's optimizer once torch is whole. torch is imported with
    the sys.path[0] the script will have (run_script, run_module), as the script would import it."""
    sys.path[0] = os.getcwd() if argv[0] == "-m" else os.path.dirname(os.path.realpath(argv[0]))
    warm = WarmWord(os.environ.get(STATUS_FD) if os.environ.get(SPARE) == "1" else None)
    source = os.environ.pop(SPARE_SOURCE_FD, None)  # a spare source's forks are no sources
    wake_r, wake_w = os.pipe() if source is not None else (-1, -1)
    loader = threading.Thread(target=lambda: _preload(wake_w) and warm.say(), name="gpuherd-standby", daemon=True)
    loader.start()
    if source is not None and not _spare_fork().serve(int(source), wake_r, loader):
        # a spare forked from the warm source: warm at once, said on its own status pipe
        warm = WarmWord(os.environ.get(STATUS_FD) if os.environ.get(SPARE) == "1" else None)
        warm.say()
    line = (stdin or sys.stdin.buffer).readline()
    warm.promoted()
    if not line.strip():
        return False
    env = json.loads(line)["env"]
    own_fd = os.environ.get(STATUS_FD)
    os.environ.clear()
    os.environ.update(env)
    if own_fd is not None:
        os.environ[STATUS_FD] = own_fd
    if loader.is_alive():  # promoted mid-import: the rest at this thread's priority, where allowed
        with_nice(os.getpriority(os.PRIO_PROCESS, 0), loader.native_id)
        loader.join()
    return True


def bootstrap(argv: list[str]) -> None:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit("usage: script_bootstrap.py SCRIPT ARGS... | -m MODULE ARGS...")
    if os.environ.get(STANDBY) == "1" and not stand_by(argv):
        os._exit(0)  # not needed: nothing to clean up, and torch may be mid-import in the loader thread
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _watch(int(os.environ.get("RANK", "0")))
    try:
        if argv[0] == "-m":
            run_module(argv[1], argv[2:])
        else:
            run_script(argv[0], argv[1:])
    except (SystemExit, KeyboardInterrupt):
        raise  # Python's own exit code (and its death by SIGINT) stay as they are
    except BaseException as exc:  # noqa: BLE001 - printed as Python would, minus our frames
        exc.with_traceback(_user_frames_only(exc))  # Python prints the exception's own traceback
        sys.excepthook(type(exc), exc, exc.__traceback__)
        raise SystemExit(1) from None


if __name__ == "__main__":
    bootstrap(sys.argv[1:])
