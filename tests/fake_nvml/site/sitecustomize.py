"""Test-only: installs the fake NVML in a child process when GPUHERD_TEST_FAKE_NVML
names a FakeMachine JSON. Python imports `sitecustomize` at startup from the first
PYTHONPATH entry that has one; `tests.fake_nvml.subprocess_env` puts this directory
first. Production code knows nothing about it."""

import os

if os.environ.get("GPUHERD_TEST_FAKE_NVML"):
    from pathlib import Path

    import orjson

    from tests.fake_nvml import install
    from tests.fake_nvml.machine import FakeMachine

    install(FakeMachine.from_dict(orjson.loads(Path(os.environ["GPUHERD_TEST_FAKE_NVML"]).read_bytes())))
