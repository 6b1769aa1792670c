"""NaN/Inf forensics inside a worker: detect on every rank, name the rank, the
layer and the batch, write the debug pickle (dump.py) and a checkpoint, then stop
(exit code 6) or skip the step. See guard.py for the API the loop calls."""

from worker.nan.guard import NanGuard, NanStop

__all__ = ["NanGuard", "NanStop"]
