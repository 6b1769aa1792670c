"""Policy rerun under FSDP2 through the worker's loop, two gloo ranks: the replay
clears sharded gradients, runs the micro-batches again (reduce-scatter included) and
re-clips the DTensor norm; a blow-up that comes back is reproducible on both ranks.
The recorded step (a DCP checkpoint directory and both ranks' pickles) then replays
in one CPU process."""

from __future__ import annotations

import json
from pathlib import Path

from tests.worker import helpers as h
from tests.worker.nan.replay_helpers import records


def test_a_reproducible_blow_up_under_fsdp_stops_both_ranks_with_exit_9_and_replays_offline(tmp_path: Path, capsys):
    overrides = ["training.strategy=fsdp", "debug.nan_detection=true", "debug.nan_policy=rerun",
                 "training.learning_rate=1e30", "training.warmup_steps=0", "training.max_grad_norm=0"]
    port = h.free_port()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"tmp": str(tmp_path), "status_dir": str(tmp_path),
                                "runs": [{"name": "fsdp", "port": port, "overrides": overrides}]}))
    results = h.spawn(["tests/worker/helpers.py", "train", str(spec)], [h.worker_env(r, 2, port) for r in range(2)],
                      timeout=240)
    assert [r.returncode for r in results] == [9, 9], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    for rank in range(2):
        (nan,) = [r for r in records(tmp_path / f"fsdp-rank{rank}.jsonl") if r["type"] == "nan"]
        assert (nan["classification"], nan["action"]) == ("reproducible", "stop")
    assert "Replayed on the same device:" in results[0].stderr + results[1].stderr
    checkpoint = tmp_path / "ckpt" / f"nan_grad_step_{nan['step']}.pt"
    assert (checkpoint / "meta.pt").is_file()  # an FSDP directory

    from worker.nan.replay import main

    assert main([str(checkpoint)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(": 2 rank pickle(s)")
    assert [line.split(":")[0] for line in out if line.startswith("Rank ")] == ["Rank 0", "Rank 1"]
    assert out[-1].startswith("REPRODUCES on cpu (rank(s) [0, 1])")
