"""The benchmarks' bookkeeping: the busy mark from load averages, the MFU target of each dtype,
and the side-by-side table of docs/performance.md built from a results.md (benchmarks/table.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (benchmarks/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


common = load("common")
table = load("table")


def test_busy_mark_on_fake_load_averages() -> None:
    # 2 cores, the benchmark's own 2 threads: busy above 2 + 0.5 x 2 = 3.0
    assert common.busy_mark([0.4, 2.9, 3.0], cores=2, own_threads=2) == ""  # 3.0 is not above 3.0
    assert common.busy_mark([0.4, 3.1, None], cores=2, own_threads=2) == "busy: load 3.1 > 3.0"
    assert common.busy_mark([7.0, 2.0], cores=2, own_threads=2) == "busy: load 7.0 > 3.0"  # the highest
    assert common.busy_mark([None], cores=2, own_threads=2) == ""  # no /proc/loadavg: unknown, not busy
    assert common.busy_mark([], cores=2, own_threads=2) == ""
    # before any benchmark runs (own threads 0): busy above 0.5 x 2 = 1.0
    assert common.busy_mark([1.2], cores=2, own_threads=0) == "busy: load 1.2 > 1.0"
    assert common.busy_mark([0.9], cores=2, own_threads=0) == ""
    # 16 cores, 16 own threads: 16 + 8 = 24
    assert common.busy_mark([23.9], cores=16, own_threads=16) == ""
    assert common.busy_mark([24.5], cores=16, own_threads=16) == "busy: load 24.5 > 24.0"
    assert common.busy_mark([3.0], cores=2, own_threads=2, share=0.25) == "busy: load 3.0 > 2.5"


def test_make_bench_refuses_to_start_above_half_the_cores() -> None:
    # nothing of ours runs yet: busy above 0.5 x 2 = 1.0
    assert common.start_refusal(0.9, cores=2) == ""
    assert common.start_refusal(None, cores=2) == ""
    assert common.start_refusal(1.3, cores=2) == (
        "the machine is busy before any benchmark ran (busy: load 1.3 > 1.0, 2 cores): figures would "
        "not count; wait for a quiet machine, or pass --allow-busy (rows then marked busy)"
    )


def test_rows_carry_the_marks_in_the_machine_column(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    results = tmp_path / "results.md"
    monkeypatch.setattr(common, "CORES", 2)
    monkeypatch.setattr(common, "LOADS", [2.5])  # read at the start: quiet for 2 own threads
    monkeypatch.setattr(common, "loadavg", lambda: 2.0)
    common.append_row(results, "score tokens/s", "w", "real tokens/s", "100", "10", "10.0x")
    monkeypatch.setattr(common, "loadavg", lambda: 3.4)  # high when the next row is written
    common.append_row(results, "score MFU", "w", "MFU", "60%")
    monkeypatch.setattr(common, "loadavg", lambda: 0.3)  # quiet again: the benchmark's later rows
    common.append_row(results, "score scaling", "w", "exponent", "0.9")  # still marked
    monkeypatch.setattr(common, "TINY_RUN", False)
    common.parser("doc").parse_args(["--tiny"])
    assert common.TINY_RUN  # --tiny marks the rows of this process
    common.append_row(results, "score memory", "w", "peak RSS", "5 MB")
    machines = [r["machine"] for r in table.parse(results.read_text())]
    kind = common.machine()
    assert machines == [
        kind,
        f"{kind}; busy: load 3.4 > 3.0",
        f"{kind}; busy: load 3.4 > 3.0",
        f"{kind}; tiny; busy: load 3.4 > 3.0",
    ]
    assert [table.marked(r) for r in table.parse(results.read_text())] == [False, True, True, True]


def test_mfu_target_follows_the_dtype() -> None:
    assert common.mfu_target("torch.bfloat16", 0.5, bf16_units=True) == (
        ">= 50% of the bf16 peak on executed FLOPs",
        True,
    )
    assert common.mfu_target("torch.float32", 0.35, bf16_units=False) == (
        ">= 35% of the fp32 peak (bf16 peak not meaningful here: no bf16 units)",
        False,
    )
    assert common.mfu_target("torch.float32", 0.35, bf16_units=True) == (">= 35% of the fp32 peak", False)


HEAD = (
    "# Benchmark results\n\nsome text\n\n"
    "| date | machine | benchmark | workload | metric | ours | baseline | ratio | peak mem above model "
    "(ours / baseline) | target | met |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|\n"
)
A, B = "Intel Xeon, 4 cores, avx2, no bf16 units", "AMD EPYC, 2 cores, avx512, bf16 units"
C = "Ampere Altra, 8 cores, ?, no bf16 units"
MFU_A = ">= 50% of the fp32 peak (bf16 peak not meaningful here: no bf16 units)"
MFU_B = ">= 50% of the bf16 peak on executed FLOPs"
ROWS = f"""\
| 2026-01-01 00:00 | {A} | score tokens/s | w | real tokens/s | 1 | 1 | 1.0x | - | >= 10x | **no** |
| 2026-01-01 01:00 | {A} | matmul peak | 2048 | GFLOP/s | 100 / 10.0 (1.0) | - | - | - | - | - |
| 2026-01-01 01:01 | {A} | score tokens/s | w | real tokens/s | 1000 | 100 | 10.0x | - | >= 10x | yes |
| 2026-01-01 01:02 | {A} | score MFU | w | MFU | 60% / 6% | 20% / 2% | - | - | {MFU_A} | yes |
| 2026-01-01 01:03 | {A} | score tokens/s | w | real tokens/s | 5 | 1 | 5.0x | - | >= 10x | **no** |
| 2026-01-01 01:04 | {A} | learning: best score | w | best | 0.7 | 0.8 | - | - | - | **no** |
| 2026-01-01 02:00 | {B} | matmul peak | 2048 | GFLOP/s | 180 / 436.0 (500.0) | - | - | - | - | - |
| 2026-01-01 02:01 | {B} | score tokens/s | w | real tokens/s | 3000 | 350 | 8.6x | - | >= 10x | **no** |
| 2026-01-01 02:02 | {B} | score MFU | w | MFU | 56% / 24% [40% / 17%] | 9% / 4% | - | - | {MFU_B} | **no** |
| 2026-01-01 02:02 | {B} | generate tokens/s, vllm engine | vLLM is not installed (make vllm) | - | - | - | - | - | - | - |
| 2026-01-01 02:03 | {B} | train LoRA tokens/s | w | real tokens/s | 44 | 72 | 0.61x | 1 MB / 2 MB | - | - |
| 2026-01-01 03:00 | {A} | matmul peak | 2048 | GFLOP/s | 101 / 10.0 (1.0) | - | - | - | - | - |
| 2026-01-01 03:01 | {A} | generate tokens/s | w | sampled tokens/s | 200 | 60 | 3.3x | - | >= 2x | yes |
| 2026-01-01 04:00 | {B} | matmul peak | 2048 | GFLOP/s | 190 / 440.0 (500.0) | - | - | - | - | - |
| 2026-01-01 04:01 | {B} | score tokens/s | w | real tokens/s | 9999 | 350 | 28.6x | - | >= 10x | yes |
| 2026-01-01 04:02 | {B}; busy: load 3.4 > 3.0 | score MFU | w | MFU | 99% | 9% | - | - | {MFU_B} | yes |
| 2026-01-01 05:00 | {B}; tiny | matmul peak | 512 | GFLOP/s | 11 / 700.0 (500.0) | - | - | - | - | - |
| 2026-01-01 05:01 | {B}; tiny | score tokens/s | w | real tokens/s | 66 | 3222 | 0.0x | - | >= 10x | **no** |
| 2026-01-01 05:02 | {B}; tiny | score MFU | w | MFU | 0% | 5% | - | - | {MFU_B} | **no** |
| 2026-01-01 06:00 | {C}; busy: load 20.0 > 12.0 | matmul peak | 2048 | GFLOP/s | 50 / 5.0 (1.0) | - | - | - | - | - |
| 2026-01-01 06:01 | {C} | score tokens/s | w | real tokens/s | 500 | 100 | 5.0x | - | >= 10x | **no** |
| 2026-01-01 06:02 | {C} | score MFU | w | MFU | 30% | 6% | - | - | {MFU_A} | **no** |
"""


def test_table_puts_the_latest_complete_quiet_run_of_each_kind_side_by_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(table, "REQUIRED", ("matmul peak", "score tokens/s", "score MFU"))
    # A: the run of 01:00 (03:00 has no score rows; the row of 00:00 precedes every run; the
    #    second score tokens/s of the run, 01:03, and the learning row are not shown).
    # B: the run of 02:00 (04:00 lost its score MFU to the busy mark; 05:00 is a tiny run).
    # C: its only run's matmul peak is busy: no complete quiet run.
    # Columns in kind order (AMD < Intel); the MFU targets differ, so each cell carries its own;
    # the vllm row has no figure in any column and is left out.
    expected = f"""\
| benchmark | metric | target | {B}<br>run of 2026-01-01 02:00 | {A}<br>run of 2026-01-01 01:00 |
|---|---|---|---|---|
| matmul peak | GFLOP/s | - | 180 / 436.0 (500.0) | 100 / 10.0 (1.0) |
| score tokens/s | real tokens/s | >= 10x | 3000 vs 350 (8.6x), **no** | 1000 vs 100 (10.0x), yes |
| score MFU | MFU | per column | 56% / 24% [40% / 17%] vs 9% / 4%, **no**; target {MFU_B} \
| 60% / 6% vs 20% / 2%, yes; target {MFU_A} |
| train LoRA tokens/s | real tokens/s | - | 44 vs 72 (0.61x) | - |

{C}: no complete quiet run in benchmarks/results.md yet.
"""
    assert table.build(table.parse(HEAD + ROWS)) == expected


def test_table_without_any_complete_run() -> None:
    rows = (
        f"| 2026-01-01 01:00 | {A} | matmul peak | 2048 | GFLOP/s | 100 / 10.0 (1.0) | - | - | - | - | - |\n"
    )
    assert table.build(table.parse(HEAD + rows)) == (
        f"No complete quiet `make bench` run in benchmarks/results.md yet.\n\n"
        f"{A}: no complete quiet run in benchmarks/results.md yet.\n"
    )


def test_readme_block_is_replaced_between_the_markers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(table, "REQUIRED", ("matmul peak", "score tokens/s", "score MFU"))
    readme = tmp_path / "README.md"
    results = tmp_path / "results.md"
    results.write_text(HEAD + ROWS)
    readme.write_text(f"# Title\n\nbefore\n\n{table.START}\nold table\n{table.END}\n\nafter\n")
    table.update_readme(readme, results)
    text = readme.read_text()
    assert text.startswith(f"# Title\n\nbefore\n\n{table.START}\n<!-- generated by benchmarks/table.py")
    assert text.endswith(f"{table.END}\n\nafter\n")
    assert "old table" not in text
    row = text.find("| score tokens/s | real tokens/s | >= 10x |")  # the new table, between the markers
    assert text.index(table.START) < row < text.index(table.END)
    table.update_readme(readme, results)  # again: the same text, one table
    assert readme.read_text() == text

    readme.write_text("# Title\n\nno markers\n")
    with pytest.raises(SystemExit, match="README.md: no '<!-- bench:start -->'"):
        table.update_readme(readme, results)
    assert readme.read_text() == "# Title\n\nno markers\n"  # nothing lost


def test_a_benchmark_that_measures_its_own_peaks_starts_a_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    results = tmp_path / "results.md"
    monkeypatch.syspath_prepend(str(BENCH))  # run_worker imports peak.py in-process for --tiny
    monkeypatch.setattr(common, "TINY_RUN", False)
    args = common.parser("doc").parse_args(["--tiny", "--results", str(results)])
    peaks = common.peaks_from(args)  # no --peaks: measured here, and recorded
    common.append_row(results, "score tokens/s", "w", "real tokens/s", "100")
    rows = table.parse(results.read_text())
    assert [r["benchmark"] for r in rows] == ["matmul peak", "score tokens/s"]
    assert rows[0]["ours"].startswith(f"{peaks['fp32_gflops']:.0f} / ")
    assert rows[0]["workload"].endswith(f"dtype auto here: {common.auto_dtype()}")
    assert table.runs(rows) == {table.kind(rows[0]): [rows]}  # one run, opened by the peak row


def test_learning_verdicts_and_mean_over_seeds(tmp_path: Path) -> None:
    """bench_learning's targets: TRL's best score reached in no more iterations, and by the time
    ours reaches it at most half of TRL's whole process has passed; seeds averaged per iteration."""
    sys.path.insert(0, str(BENCH))  # bench_learning imports common as a script does
    learning = load("bench_learning")
    keys = ("scores", "known_s", "process_s", "process_cpu_s", "loop_s")
    seed_a = dict(zip(keys, ([0.1, 0.3, 0.5], [2.0, 4.0, 6.0], 8.0, 8.0, 6.0), strict=True))
    seed_b = dict(zip(keys, ([0.1, 0.1, 0.3], [4.0, 6.0, 8.0], 10.0, 9.0, 8.0), strict=True))
    # by hand: scores (0.1+0.1)/2, (0.3+0.1)/2, (0.5+0.3)/2; known_s 3, 5, 7; process 9 s
    mean = learning.mean_of([seed_a, seed_b])
    assert mean["scores"] == pytest.approx([0.1, 0.2, 0.4])
    assert mean["known_s"] == pytest.approx([3.0, 5.0, 7.0])
    assert (mean["process_s"], mean["process_cpu_s"], mean["loop_s"]) == (9.0, 8.5, 7.0)

    trl = {"scores": [0.1, 0.4, 0.2], "process_s": 14.0, "process_cpu_s": 14.0, "loop_s": 10.0}
    results = tmp_path / "results.md"
    # seed a reaches TRL's best 0.4 at iteration 2 (TRL at 1): not in no more iterations; at 6 s,
    # and 2 x 6 s <= 14 s: the time target holds
    learning.record(results, "", "w", "", seed_a, trl)
    # the mean reaches 0.4 at iteration 2 too, at 7 s: 2 x 7 s > 13 s, the time target fails
    learning.record(results, ", mean", "w", "", mean, {**trl, "process_s": 13.0})
    rows = [r.split(" | ") for r in results.read_text().splitlines() if r.startswith("| 20")]
    verdict = {r[2]: r[-1].rstrip(" |") for r in rows}
    assert verdict["learning: best score"] == "**no**"
    assert verdict["learning: wall time"] == "yes"
    assert "TRL's best reached after 6.0s" in rows[2][5]
    assert verdict["learning: best score, mean"] == "**no**"
    assert verdict["learning: wall time, mean"] == "**no**"
