"""A fake libnvidia-ml for tests on machines without a GPU.

    with installed(machine(4, nvlink=True)) as lib:
        ...  # every pynvml call now reaches lib's ctypes callbacks
        lib.inject_xid(2, 79)

Written against nvidia-ml-py 12.535 - 13.x (the range requirements.txt pins):
the symbol names (`*_v2`, `*_v3`), struct layouts and the way pynvml loads its
library (`pynvml.nvmlLib`, `_nvmlGetFunctionPointer_cache`) are those of that range.
For subprocesses, `subprocess_env(machine, tmp_path)` makes the child's
`sitecustomize` install the same fake before anything imports pynvml.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import orjson
import pynvml

from tests.fake_nvml.library import FakeNvmlLibrary
from tests.fake_nvml.machine import (
    GIB,
    NODE,
    OLD_DRIVER_MISSING,
    PHB,
    PIX,
    PXB,
    SYS,
    FakeGpu,
    FakeMachine,
    FakeProcess,
    machine,
)

__all__ = [
    "GIB", "NODE", "OLD_DRIVER_MISSING", "PHB", "PIX", "PXB", "SYS", "FakeGpu", "FakeMachine", "FakeNvmlLibrary",
    "FakeProcess", "install", "installed", "machine", "subprocess_env", "uninstall",
]

SITE_DIR = Path(__file__).parent / "site"
ENV_VAR = "GPUHERD_TEST_FAKE_NVML"  # path of a FakeMachine JSON; read by site/sitecustomize.py


def install(fake_machine: FakeMachine) -> FakeNvmlLibrary:
    """Make pynvml talk to a fake library (as if CDLL had loaded it)."""
    lib = FakeNvmlLibrary(fake_machine)
    with pynvml.libLoadLock:
        pynvml.nvmlLib = lib
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0
    return lib


def uninstall() -> None:
    with pynvml.libLoadLock:
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0


@contextlib.contextmanager
def installed(fake_machine: FakeMachine) -> Iterator[FakeNvmlLibrary]:
    lib = install(fake_machine)
    try:
        yield lib
    finally:
        uninstall()


@contextlib.contextmanager
def no_nvml() -> Iterator[None]:
    """pynvml as on a machine without the driver: the library cannot be loaded."""
    class Missing:
        def __getattr__(self, name):
            raise AttributeError(name)
    # nvmlLib must stay non-None so pynvml does not dlopen the real one; with every
    # symbol missing, nvmlInit fails like a machine whose libnvidia-ml is unusable.
    with pynvml.libLoadLock:
        pynvml.nvmlLib = Missing()
        pynvml._nvmlGetFunctionPointer_cache.clear()
    try:
        yield
    finally:
        uninstall()


def subprocess_env(fake_machine: FakeMachine, tmp_path: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child Python that must see `fake_machine` instead of NVML."""
    path = tmp_path / "fake_machine.json"
    path.write_bytes(orjson.dumps(fake_machine.to_dict()))
    env = dict(os.environ if base is None else base)
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), repo, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env[ENV_VAR] = str(path)
    return env
