"""worker/heap.py: the imports go to the permanent generation once; what training makes after
stays collectable (a broken group's cycles must still be freed)."""

import subprocess
import sys

SCRIPT = """
import gc, weakref
from worker.heap import freeze_imports

class Node:
    pass

old = Node(); old.self = old  # alive at the freeze: frozen, never walked again
freeze_imports()
frozen = gc.get_freeze_count()
assert frozen > 0
freeze_imports()
assert gc.get_freeze_count() == frozen, "a second call froze again"
new = Node(); new.self = new  # a cycle made after the freeze
gone = weakref.ref(new)
del new
walked = len(gc.get_objects())
assert gc.collect() >= 1 and gone() is None, "a cycle made after the freeze was not collected"
print(frozen, walked)
"""


def test_imports_are_frozen_once_and_later_cycles_are_still_collected():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    frozen, walked = map(int, out.stdout.split())
    assert walked < frozen  # a full collection now walks fewer objects than the frozen imports
