"""torch's file-based watchdog timer server, in a process of its own (the supervisor never imports torch).

    python -m supervisor.torchrun.file_timer_main FIFO_PATH RUN_ID

What torchrun's agent runs in a thread when TORCHELASTIC_ENABLE_FILE_TIMER=1
(torch.distributed.elastic.timer.FileTimerServer): ranks that call
`timer.configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))` and
`with timer.expires(after=S, scope=...)` send their timers over the FIFO; an expired one's
rank is killed with the timer's signal (SIGKILL by default). torch's server then kills its
own process too (under torchrun: the agent); here that is this helper, started afresh for
the next attempt. Each event is one JSON line on stdout, which the supervisor points at
`file-timer.log` in the attempt's log directory: {"event", "pid", "scope", "signal"}.
End of file on stdin (the supervisor stopped it, or is gone) stops the server.
"""

from __future__ import annotations

import json
import sys


def _emit(name: str, request: object) -> None:
    record = {"event": name, "pid": getattr(request, "worker_pid", None),
              "scope": getattr(request, "scope_id", None), "signal": getattr(request, "signal", None)}
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def serve(path: str, run_id: str) -> None:
    from torch.distributed.elastic.timer import FileTimerServer

    server = FileTimerServer(file_path=path, run_id=run_id, max_interval=0.1, daemon=True, log_event=_emit)
    server.start()
    sys.stdin.read()  # until the supervisor closes it
    server.stop()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
