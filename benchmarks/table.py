"""The Performance table of docs/performance.md, built from benchmarks/results.md: the latest complete, quiet
`make bench` run of each kind of CPU, side by side (one column per kind, one row per metric).

A run is the rows from a "matmul peak" row (run_all.py writes it first; a benchmark run alone
that measures its own peaks writes one too) up to the next "matmul peak" row of the same kind.
A kind is the machine column without its marks ("AMD EPYC, 2 cores, avx2, no bf16 units").
Rows marked "busy" (taken while the load average was high, see common.busy_mark) or "tiny"
are left out; a run is complete when its remaining rows include every row of REQUIRED.
run_all.py rewrites the block between START and END in docs/performance.md (PAGE) after a `make bench`;
`python benchmarks/table.py` does it from the results as they are.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAGE = HERE.parent / "docs" / "performance.md"  # the page whose table run_all.py rewrites
COLUMNS = (
    "date",
    "machine",
    "benchmark",
    "workload",
    "metric",
    "ours",
    "baseline",
    "ratio",
    "mem",
    "target",
    "met",
)
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
# The rows every `make bench` run has given since the first one; the vllm rows (need
# .venv-vllm) and the LoRA rows (added later) are shown when the run has them.
REQUIRED = (
    "matmul peak",
    "cli --help",
    "stage start-up",
    "score tokens/s",
    "score MFU",
    "score scaling",
    "score memory @ vocab 128k",
    "generate tokens/s",
    "advantage vs MCAdvantage",
    "advantage group statistics",
    "advantage stage peak memory",
    "train tokens/s",
    "train MFU",
    "train padding",
    "train scaling",
)
NOT_SHOWN = ("learning:", "staleness:")  # not part of `make bench`: their own sections of the page

Row = dict[str, str]


def parse(text: str) -> list[Row]:
    """The result rows of a results.md, in file order (cells hold no '|': append_row replaces it)."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("| "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(COLUMNS) or cells[0] == "date":
            continue
        rows.append(dict(zip(COLUMNS, cells, strict=True)))
    return rows


def kind(row: Row) -> str:
    return row["machine"].split(";")[0].strip()


def marked(row: Row) -> bool:
    """Busy or tiny: never shown as a run's figures."""
    marks = [m.strip() for m in row["machine"].split(";")[1:]]
    return any(m.startswith(("busy", "tiny")) for m in marks)


def runs(rows: list[Row]) -> dict[str, list[list[Row]]]:
    """kind -> its runs in file order; rows of a kind before its first "matmul peak" belong to none."""
    out: dict[str, list[list[Row]]] = {}
    for row in rows:
        mine = out.setdefault(kind(row), [])
        if row["benchmark"] == "matmul peak":
            mine.append([])
        if mine:
            mine[-1].append(row)
    return out


def latest_complete(kind_runs: list[list[Row]]) -> dict[str, Row] | None:
    """benchmark -> row of the latest run whose unmarked rows include every REQUIRED row (a name
    given twice in a run: its first row)."""
    for run in reversed(kind_runs):
        shown: dict[str, Row] = {}
        for row in run:
            if not marked(row) and not row["benchmark"].startswith(NOT_SHOWN):
                shown.setdefault(row["benchmark"], row)
        if all(name in shown for name in REQUIRED):
            return shown
    return None


def cell(row: Row | None, with_target: bool = False) -> str:
    """ours [vs baseline] [(ratio)] [, met] [; target: ...] (the target where kinds differ in it)."""
    if row is None:
        return "-"
    text = row["ours"]
    if row["baseline"] != "-":
        text += f" vs {row['baseline']}"
    if row["ratio"] != "-":
        text += f" ({row['ratio']})"
    if row["met"] != "-":
        text += f", {row['met']}"
    if with_target and row["target"] != "-":
        text += f"; target {row['target']}"
    return text


def build(rows: list[Row]) -> str:
    """The markdown of the side-by-side table and a line per kind that has no complete quiet run."""
    by_kind = runs(rows)
    chosen = {k: r for k in sorted(by_kind) if (r := latest_complete(by_kind[k])) is not None}
    missing = [k for k in sorted(by_kind) if k not in chosen]
    lines = []
    if chosen:
        heads = [f"{k}<br>run of {r['matmul peak']['date']}" for k, r in chosen.items()]
        lines += ["| benchmark | metric | target | " + " | ".join(heads) + " |"]
        lines += ["|---|---|---|" + "---|" * len(chosen)]
        names = list(dict.fromkeys(name for r in chosen.values() for name in r))
        for name in names:
            found = [r[name] for r in chosen.values() if name in r]
            metric = found[0]["metric"]
            targets = {x["target"] for x in found}
            differ = len(targets) > 1
            target = "per column" if differ else targets.pop()
            cells = [cell(r.get(name), differ) for r in chosen.values()]
            if all(c == "-" for c in cells):
                continue  # no figure anywhere (a vllm row where vLLM is not installed)
            lines.append(f"| {name} | {metric} | {target} | " + " | ".join(cells) + " |")
    else:
        lines.append("No complete quiet `make bench` run in benchmarks/results.md yet.")
    for k in missing:
        lines.append(f"\n{k}: no complete quiet run in benchmarks/results.md yet.")
    return "\n".join(lines) + "\n"


def replace_block(readme: str, table: str, name: str = "README.md") -> str:
    """`readme` with the text between START and END replaced by `table`."""
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{name}: no '{START}' ... '{END}' block for the benchmark table")
    note = "<!-- generated by benchmarks/table.py from benchmarks/results.md; do not edit by hand -->\n"
    return readme[: start + len(START)] + "\n" + note + "\n" + table + "\n" + readme[end:]


def update_readme(readme: Path, results: Path) -> None:
    """Rewrite the table in `readme` from `results` (a new file renamed over the old one)."""
    text = replace_block(readme.read_text(), build(parse(results.read_text())), str(readme))
    tmp = readme.with_name(readme.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, readme)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--results", type=Path, default=HERE / "results.md")
    p.add_argument("--readme", type=Path, default=PAGE, help="the page holding the table")
    args = p.parse_args()
    update_readme(args.readme, args.results)
    print(f"{args.readme}: benchmark table rewritten from {args.results}")


if __name__ == "__main__":
    main()
