"""Which tests start a process: decided at collection (for `-m "not integration"`) and
checked while a test runs (so a test the collection missed fails instead of hiding).

At collection, a test's code is followed through everything it can reach by name: the
test function, its fixtures, and every function or class of this repository (tests,
product, bench) that those name, recursively. A test reaches a process starter when any
of that code (default arguments included) names `subprocess`, `multiprocessing`, `pty`, a process pool, `os.fork`,
`os.system`, `os.posix_spawn`/`os.spawn*`/`os.exec*`, `torch.multiprocessing`, or
`torch.compile` (inductor runs the C++ compiler and its compile workers as processes). Code
outside the repository (torch, the standard library) is not followed: what it starts on
its own is caught by the run-time check below.

While a test that was not marked runs, `Popen`, `os.fork`, `os.posix_spawn[p]` and
`multiprocessing`'s `start` are wrapped: a test that starts a process anyway fails at
its end, naming what it started, so the collection rule (or an explicit
`@pytest.mark.integration`) gets fixed instead of the fast tier quietly starting
processes.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing.process
import os
import subprocess
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_STARTER_MODULES = {"subprocess", "multiprocessing", "pty", "concurrent.futures.process", "torch.multiprocessing"}
_OS_STARTERS = {"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "spawnv", "spawnve",
                "spawnl", "spawnle", "spawnlp", "spawnvp", "execv", "execve", "execvp", "execl", "execlp"}
_POOLS = {"ProcessPoolExecutor"}


def _in_repo(obj: object) -> bool:
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        return False
    return path is not None and _repo_source(path)


@functools.cache
def _repo_source(path: str) -> bool:
    """A source file of this repository's own code; each file resolved once (a collection asks
    about some 20,000 functions and classes from a few hundred files)."""
    resolved = Path(path).resolve()
    # this module's own wrappers name every starter: the watch is not a test's process
    return resolved.is_relative_to(REPO) and ".venv" not in resolved.parts and resolved != Path(__file__).resolve()


def _names_a_starter(value: object, attrs: set[str]) -> bool:
    if isinstance(value, types.ModuleType):
        name = value.__name__
        if name in _STARTER_MODULES or name.startswith("multiprocessing."):
            return True
        if name == "os":
            return bool(attrs & _OS_STARTERS)
        if name in ("concurrent.futures", "torch"):
            # torch.compile: inductor runs the C++ compiler and compile workers in processes
            return bool(attrs & (_POOLS | {"multiprocessing", "compile"}))
        return False
    module = getattr(value, "__module__", None) or ""
    return module in _STARTER_MODULES or module.startswith("multiprocessing.") or \
        getattr(value, "__name__", None) in _POOLS | {"fork", "posix_spawn", "posix_spawnp", "system"} and module in ("os", "posix")


class Reach:
    """Memoised: does this function, class or code object reach a process starter?"""

    def __init__(self) -> None:
        self._seen: dict[int, bool] = {}

    def function(self, fn: object) -> bool:
        fn = inspect.unwrap(fn) if callable(fn) else fn
        if isinstance(fn, (staticmethod, classmethod)):
            fn = fn.__func__
        if isinstance(fn, type):
            return self._class(fn)
        code = getattr(fn, "__code__", None)
        if code is None or not _in_repo(fn):
            return False
        key = id(code)
        if key in self._seen:
            return self._seen[key]
        self._seen[key] = False  # recursion: assume no until shown
        defaults = [*(getattr(fn, "__defaults__", None) or ()), *(getattr(fn, "__kwdefaults__", None) or {}).values()]
        found = self._code(code, getattr(fn, "__globals__", {})) or \
            any(callable(d) and (_names_a_starter(d, set()) or self.function(d)) for d in defaults)  # `run=subprocess.run`, `expand=hostnames`
        self._seen[key] = found
        return found

    def _class(self, cls: type) -> bool:
        if not _in_repo(cls):
            return False
        key = id(cls)
        if key in self._seen:
            return self._seen[key]
        self._seen[key] = False
        found = False
        for klass in cls.__mro__:
            if klass is object or not _in_repo(klass):
                continue
            for member in vars(klass).values():
                if isinstance(member, property):
                    member = member.fget
                if (inspect.isfunction(member) or isinstance(member, (staticmethod, classmethod))) \
                        and self.function(member):
                    found = True
                    break
            if found:
                break
        self._seen[key] = found
        return found

    def _code(self, code: types.CodeType, globs: dict) -> bool:
        names = set(code.co_names)
        for name in code.co_names:
            if name in globs:
                value = globs[name]
                if _names_a_starter(value, names):
                    return True
                if isinstance(value, types.ModuleType):
                    if self._module_attrs(value, names):
                        return True
                elif (callable(value) or isinstance(value, type)) and self.function(value):
                    return True
        return any(self._code(const, globs) for const in code.co_consts if isinstance(const, types.CodeType))

    def _module_attrs(self, module: types.ModuleType, attrs: set[str]) -> bool:
        """`helpers.run_supervisor(...)`: the attributes this code reads off a repo module."""
        if not _in_repo(module):
            return False
        for attr in attrs:
            value = getattr(module, attr, None)
            if value is None:
                continue
            if _names_a_starter(value, attrs) or (callable(value) and self.function(value)):
                return True
        return False


def starts_processes(item, reach: Reach) -> bool:
    """The test function and every fixture it uses (pytest's closure, autouse included)."""
    if reach.function(getattr(item, "function", None)):
        return True
    infos = getattr(item, "_fixtureinfo", None)
    if infos is None:
        return False
    for defs in infos.name2fixturedefs.values():
        for fixturedef in defs:
            if reach.function(fixturedef.func):
                return True
    return False


class Watch:
    """While an unmarked test runs: note every process it starts (they still start)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._undo: list[tuple[object, str, object]] = []

    def __enter__(self) -> Watch:
        self._wrap(subprocess.Popen, "_execute_child", lambda args, *a, **k: f"subprocess {_argv(args[1])}")
        self._wrap(os, "fork", lambda *a, **k: "os.fork()")
        self._wrap(os, "posix_spawn", lambda args, *a, **k: f"os.posix_spawn {args[0]}")
        self._wrap(os, "posix_spawnp", lambda args, *a, **k: f"os.posix_spawnp {args[0]}")
        self._wrap(multiprocessing.process.BaseProcess, "start", lambda *a, **k: "a multiprocessing process")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)

    def _wrap(self, owner: object, name: str, what) -> None:
        original = getattr(owner, name)
        watch = self

        def wrapper(*args, **kwargs):
            watch.started.append(what(args, **kwargs) if name != "start" else what())
            return original(*args, **kwargs)

        self._undo.append((owner, name, original))
        setattr(owner, name, wrapper)


def _argv(args: object) -> str:
    text = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
    return text[:120]
