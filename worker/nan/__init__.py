"""Forensics of suspicious steps inside a worker: NaN/Inf and loss / gradient-norm
spikes. Detect on every rank, name the rank, the layer and the batch, write seed
003's debug pickle and checkpoint, then stop (exit 6), skip the step, or replay it
to tell a flaky device (exit 8 when one keeps failing) from a bad batch or model
(exit 9). See guard.py for the API the loop calls."""

from worker.nan.consensus import device_label, hostname
from worker.nan.guard import NanGuard, NanStop

__all__ = ["NanGuard", "NanStop", "device_label", "hostname"]  # device_label, hostname: worker/sdc's banner
