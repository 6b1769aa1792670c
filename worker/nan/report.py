"""`python -m worker.nan.report FILE.pkl [--all]`: the banner again, from a dump.

Prints the summary the worker logged (same renderer: the NaN banner, or the
spike banner for a spike's dump), then what the file holds, the batch's samples
included. Works on dumps without the 'report' entry (e.g. written by another
tool in the same layout) by recomputing the findings from the arrays. Bad
input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from gpuherd.exit_codes import ExitCode
from worker.nan.banner import NanReport, SpikeReport, render, render_spike
from worker.nan.dump import UntrustedPickle, load
from worker.nan.findings import finding_from_array, finding_from_dict
from worker.nan.samples import SampleName

SAMPLES_SHOWN = 8


def report_from_dump(data: dict[str, Any]) -> NanReport:
    saved = data.get("report")
    if isinstance(saved, dict):
        return NanReport(**{
            **saved,
            "gradients": [finding_from_dict(f) for f in saved.get("gradients", [])],
            "parameters": [finding_from_dict(f) for f in saved.get("parameters", [])],
        })
    shapes = data.get("shapes", {})
    grads = [finding_from_array(n, a, shapes.get(n)) for n, a in data["gradients"].items()]
    params = [finding_from_array(n, a, shapes.get(n)) for n, a in data["parameters"].items()]
    bad_grads = [f for f in grads if f.non_finite]
    bad_params = [f for f in params if f.non_finite]
    bad = {f.name for f in bad_grads + bad_params}
    order = list(data["parameters"]) + [n for n in data["gradients"] if n not in data["parameters"]]
    tag = data.get("tag")
    bracket = f"[{tag[:3]} {tag[3:]}]" if isinstance(tag, str) and len(tag) > 3 else "[?]"
    return NanReport(
        bracket=bracket, step=int(data.get("step", -1)), loss=float(data.get("loss", math.nan)),
        grad_norm=float(data.get("grad_norm", math.nan)), lr=data.get("lr"),
        gradients=bad_grads, parameters=bad_params, affected_layers=[n for n in order if n in bad],
        first_bad_module=data.get("first_bad_module"), first_bad_gradient=data.get("first_bad_gradient"),
        ranks=data.get("ranks", []), sharded=bool(data.get("sharded", False)), hooks=True,
    )


def describe_file(data: dict[str, Any]) -> list[str]:
    lines = [f"Rank {data.get('rank', '?')} of {data.get('world_size', '?')} on {data.get('host', '?')},"
             f" device {data.get('device', '?')}, policy {data.get('policy', '?')} -> {data.get('action', '?')}"]
    batches = data.get("batch_token_ids") or []
    if batches:
        shapes = ", ".join(str(list(getattr(b, "shape", []))) for b in batches)
        lines.append(f"Batch token ids: {len(batches)} micro-batch(es) of shape {shapes}")
    if data.get("classification"):
        lines.append(f"Replayed by policy rerun: {data['classification']}")
    samples = [SampleName(**raw) for raw in data.get("batch") or []]
    if samples:
        lines.append(f"Samples ({len(samples)}):")
        lines += [f"  • {name.describe()}" for name in samples[:SAMPLES_SHOWN]]
        if len(samples) > SAMPLES_SHOWN:
            lines.append(f"  ... and {len(samples) - SAMPLES_SHOWN} more (the pickle's 'batch')")
    lines.append(f"Arrays: {len(data['parameters'])} parameters, {len(data['gradients'])} gradients")
    lines += [f"Note: {note}" for note in data.get("notes", [])]
    return lines


def banner(data: dict[str, Any], bullets: int | None) -> list[str]:
    spike = data.get("spike")
    if isinstance(spike, dict):
        return render_spike(SpikeReport(**spike))
    return render(report_from_dump(data), bullets=bullets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.nan.report", description=__doc__.splitlines()[0])
    parser.add_argument("dump", type=Path, help="a nan_debug_step_*.pkl file")
    parser.add_argument("--all", action="store_true", help="list every affected tensor, not only the first 30")
    args = parser.parse_args(argv)
    try:
        data = load(args.dump)
        lines = banner(data, bullets=None if args.all else 30)
    except UntrustedPickle as exc:
        print(f"worker.nan.report: error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    except (OSError, ValueError, KeyError, TypeError, EOFError) as exc:
        print(f"worker.nan.report: error: cannot read {args.dump}: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except Exception as exc:  # unpickling errors come in many types
        print(f"worker.nan.report: error: {args.dump} is not a readable pickle: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return int(ExitCode.USAGE)
    print("\n".join(lines + describe_file(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
