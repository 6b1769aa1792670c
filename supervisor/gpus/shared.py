"""Several ranks on one GPU, for gpuherd's own tests only (`system.shared_gpu_for_tests`).

A machine lent for GPU tests often has one GPU, and what makes gpuherd different needs two ranks
or more: a warm spare taking a lost rank, a shrink, an FSDP shard recovered from its neighbour's
copy, the SDC check comparing replicas. With this setting every rank (`--nproc N`, default
`system.nproc`) and every warm spare runs on the same GPU, each seeing it alone as `cuda:0`
(CUDA_VISIBLE_DEVICES is that GPU's id for all of them), and the collectives go over gloo:
NCCL refuses one device twice in a communicator. It is never a default and never chosen for
the user: without it, a second rank on a GPU is refused as before (`--gpus 0,0`, `--nproc 2`
on one GPU). Step times then measure ranks that share one GPU's compute and a host-memory
collective: fit for what recovery does and costs relative to a step, not for throughput.
"""

from __future__ import annotations

from gpuherd.config import SystemConfig
from gpuherd.errors import DeviceError
from gpuherd.exit_codes import ExitCode

SETTING = "system.shared_gpu_for_tests"


def shared_gpu_request(system: SystemConfig) -> list[int] | None:
    """The one GPU the shared plan may take (`--gpus`, `system.device_id`), None for the first
    allowed one; refuses (exit 2) what cannot share one GPU: CPU workers, NCCL, several GPUs."""
    if system.device == "cpu":
        raise DeviceError(f"{SETTING} puts every rank on one GPU, but system.device=cpu", ExitCode.USAGE)
    if system.backend == "nccl":
        raise DeviceError(f"{SETTING}: NCCL refuses one GPU twice in a communicator; the ranks use gloo "
                          "(leave system.backend at auto, or set gloo)", ExitCode.USAGE)
    requested = system.gpus if system.gpus is not None else (
        [system.device_id] if system.device_id is not None else None)
    if requested is not None and len(requested) != 1:
        raise DeviceError(f"{SETTING} puts every rank on one GPU, but --gpus names {len(requested)}: "
                          f"{','.join(map(str, requested))}", ExitCode.USAGE)
    return requested


def no_gpu_to_share(cuda_visible_devices: str | None) -> DeviceError:
    why = (f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} hides every GPU" if cuda_visible_devices is not None
           else "NVML unavailable or no GPU")
    return DeviceError(f"{SETTING} needs a CUDA GPU to share, but none is usable ({why})", ExitCode.USAGE)


def shared_warning(ranks: int, gpu_id: int) -> str:
    """The one WARNING line a shared run starts with."""
    return (f"{SETTING}: {ranks} ranks and every warm spare share GPU {gpu_id}, collectives over gloo: "
            "for gpuherd's own GPU tests only; step times are no measure of throughput")
