"""Silent data corruption: data-parallel replicas that must hold the same bits are compared after
optimizer steps, a corrupted one is named and healed in place (docs/guide/silent-data-corruption.md).

fingerprint.py  a tensor -> the wrapping sum of its raw 64-bit words (exact, order-free)
blame.py        every rank's sums -> who is wrong (majority; recompute evidence for two)
heal.py         a healthy rank's state by broadcast; the kept state a rollback recomputes from
recompute.py    FSDP (nothing replicated): the optimizer step recomputed and compared bit for bit
injector.py     GPUHERD_INJECT_BITFLIP: one flipped bit, for tests
check.py        the trainer's hook tying them together (SdcCheck)
parts.py        what SdcCheck is built from: its settings, the group, the loop's hooks
"""

from worker.sdc.check import SdcCheck
from worker.sdc.parts import Group, Loop, SdcSettings

__all__ = ["Group", "Loop", "SdcCheck", "SdcSettings"]
