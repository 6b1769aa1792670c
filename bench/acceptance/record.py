"""The acceptance run as a dated section: which parts ran where, passed, failed or were skipped
(each with its reason), and every figure with the device it was measured on."""

from __future__ import annotations

import os

from bench.acceptance.run_parts import PartResult


def section(machine: dict[str, str], results: list[PartResult], gpu: bool, command: str, budget_s: float,
            seconds: float) -> str:
    commit = os.environ.get("ACCEPTANCE_COMMIT") or machine["commit"]
    what = f"GPU acceptance on {machine['gpu']}" if gpu else "GPU acceptance, rehearsed on a CPU (no GPU figure)"
    lines = [f"## {machine['date']} — {what} (commit {commit})", "",
             f"- machine: {machine['cpu']}; GPU: {machine['gpu']} (driver {machine['driver']}); python "
             f"{machine['python']}, torch {machine['torch']}",
             f"- `{command}`: {seconds:.0f} s of a {budget_s:.0f} s budget; each part in a process of its own under "
             "its limit (bench/acceptance/plan.py), its output in gpu_acceptance.log", "",
             "| part | status | seconds (limit) | device | detail |", "|---|---|---|---|---|"]
    for r in results:
        device = (r.outcome or {}).get("device", "")
        lines.append(f"| {r.part.name} | {r.status} | {r.seconds:.0f} ({r.limit_s:.0f}) | {device} | "
                     f"{_cell(r.detail)} |")
    bad = [r.part.name for r in results if r.status in ("failed", "timed out", "not run")]
    missed = [f"{r.part.name}: {row['measure']} {row['value']} (goal {row['goal']})" for r in results
              for row in (r.outcome or {}).get("rows", []) if row.get("met") is False]
    lines += ["", f"Not passed: {', '.join(bad)}." if bad else "Every part that ran passed.",
              *([f"Goals not met: {_cell('; '.join(missed))}."] if missed else []), ""]
    for r in results:
        if r.outcome and (r.outcome.get("rows") or r.outcome.get("notes")):
            lines += _part_lines(r)
    return "\n".join(lines)


def _part_lines(r: PartResult) -> list[str]:
    out = r.outcome or {}
    lines = [f"### {r.part.name}: {r.part.title}", "", f"On {out.get('device', '?')}.", ""]
    if out.get("rows"):
        lines += ["| measure | value | goal | met |", "|---|---|---|---|"]
        for row in out["rows"]:
            met = {True: "yes", False: "**no**", None: ""}[row.get("met")]
            lines.append(f"| {_cell(row['measure'])} | {_cell(row['value'])} | {_cell(row.get('goal', ''))} | {met} |")
        lines.append("")
    lines += [f"- {_cell(note)}" for note in out.get("notes", [])]
    return lines + ([""] if out.get("notes") else [])


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def summary_table(results: list[PartResult]) -> str:
    """The last lines printed: a lent machine's reply carries the end of the output."""
    rows = [f"{r.part.name:<12} {r.status:<10} {r.seconds:6.0f} s  {r.detail[:90]}" for r in results]
    return "\n".join(["acceptance: part         status      time", *("acceptance: " + row for row in rows)])
