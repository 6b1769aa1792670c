#!/usr/bin/env python3
"""Sample text from a training checkpoint: `gpuherd generate` (worker/generate.py).

    python3 generate.py --checkpoint .checkpoints/step_0000100.pt --prompt "Once upon a time"
    python3 generate.py --checkpoint .checkpoints --prompt "ROMEO:" --max-new-tokens 200 --top-k 50
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the repo's packages, from any cwd

from gpuherd.extras import extras_named  # noqa: E402

if __name__ == "__main__":
    with extras_named("generate.py"):
        from worker.generate import main

        sys.exit(main(prog="generate.py"))
