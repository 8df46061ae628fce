"""Progress: tqdm bars on a terminal; log lines (one per interval plus a summary) elsewhere."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from rlhf_batch.runtime.progress import LineProgress, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_tqdm_bar_and_a_log_gets_lines() -> None:
    from tqdm import tqdm

    term, log = Terminal(), io.StringIO()
    with progress_bar(total=3, desc="score", unit="tok", file=term) as bar:
        assert isinstance(bar, tqdm)
        bar.update(3)
    assert "\r" in term.getvalue() and "3/3" in term.getvalue()
    with progress_bar(total=3, desc="score", unit="tok", file=log) as bar:
        assert isinstance(bar, LineProgress)
        bar.update(3)
    assert "\r" not in log.getvalue()
    assert log.getvalue().startswith("score: done 3/3 tok in 0:00:00 (")


def test_line_shows_done_total_rate_and_eta() -> None:
    bar = LineProgress(total=100, desc="score", unit="tok", file=io.StringIO(), interval=10)
    bar.start, bar.first, bar.n = 0.0, (0.0, 0.0), 25
    # 25 tokens in 5 s: 5 tok/s; 75 left at 5 tok/s (since the first update, here the start): 15 s
    assert bar.line(5.0) == "score: 25/100 tok (25%), 5 tok/s, ETA 0:00:15"
    bar.set_postfix(loss="0.5")
    bar.n = 2500.0
    bar.total = 10000
    # 2500 in 2 s: 1250/s -> "1.2k"; 7500 left / 1250 = 6 s
    assert bar.line(2.0) == "score: 2500/10000 tok (25%), 1.2k tok/s, ETA 0:00:06, loss=0.5"


def test_one_line_per_interval_and_one_summary() -> None:
    out = io.StringIO()
    bar = LineProgress(total=1000, desc="generate", unit="rollout", file=out, interval=3600)
    for _ in range(1000):
        bar.update(1)  # the interval never passes: no line until the end
    assert out.getvalue() == ""
    bar.close()
    bar.close()  # closing twice writes one summary
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("generate: done 1000/1000 rollout in ")

    out = io.StringIO()
    bar = LineProgress(total=4, desc="train", unit="step", file=out, interval=0)
    for _ in range(4):
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines[:4]] == [
        f"train: {i}/4 step ({25 * i}%)" for i in (1, 2, 3, 4)
    ]
    assert len(lines) == 5 and lines[4].startswith("train: done 4/4 step in ")


def test_disabled_writes_nothing() -> None:
    out = io.StringIO()
    with LineProgress(total=2, desc="x", unit="it", file=out, interval=0, disable=True) as bar:
        bar.update(2)
    assert out.getvalue() == ""


def test_a_stage_under_cron_writes_lines_not_bars(tmp_path: Path, tiny_model: Path) -> None:
    """`rlhf-batch import` with stderr to a file: plain lines, no carriage returns."""
    import json

    rows = [{"prompt": f"a*{i}=", "response": "a" * i} for i in range(1, 6)]
    src = tmp_path / "ext.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = tmp_path / "log"
    env = {**os.environ, "RLHF_BATCH_PROGRESS_SECONDS": "0"}
    with open(log, "w") as err:
        code = subprocess.run(
            [sys.executable, "-m", "rlhf_batch", "import", str(src), "--run-dir", str(tmp_path / "run")]
            + ["--set", f"policy_model={tiny_model}", "--set", "device=cpu"],
            stderr=err,
            env=env,
            timeout=300,
        ).returncode
    text = log.read_text()
    assert code == 0, text
    assert "\r" not in text
    assert "import: 5/5 row (100%)" in text and "import: done 5/5 row in " in text


def test_line_progress_takes_a_total_and_start_set_after_creation(capsys) -> None:
    """train opens its bar before it knows its steps, then sets total / initial / n and refreshes
    (as a tqdm bar allows): the summary counts from the resumed step."""
    from rlhf_batch.runtime.progress import LineProgress

    bar = LineProgress(None, "train", "step", interval=3600)
    bar.total, bar.initial, bar.n = 10, 4, 4
    bar.refresh()
    for _ in range(6):
        bar.update(1)
    bar.close()
    assert "train: done 10/10 step" in capsys.readouterr().err


def test_eta_is_measured_from_the_first_update_and_tok_s_over_all_the_time() -> None:
    import time

    from rlhf_batch.runtime.progress import LineProgress, Rate

    bar = LineProgress(total=10, desc="generate", unit="rollout", interval=1e9)
    assert bar.eta(time.monotonic()) is None  # nothing measured yet: no ETA
    # the first update came at t = 100 with n = 1 (that unit paid the warm-up); at t = 102, n = 3:
    # rate (3 - 1) / (102 - 100) = 1 unit/s, 10 - 3 = 7 left -> 7 s (not (10 - 3) / (3 / elapsed))
    bar.first, bar.n = (100.0, 1.0), 3.0
    assert bar.eta(102.0) == 7.0
    rate = Rate()
    rate.start = time.perf_counter() - 2.0  # 2 s ago
    rate.n = (
        100.0  # two steps of 6 and 94 tokens: shown as one rate, 100 / 2 = 50 (a little less: time ran on)
    )
    assert 45 <= float(f"{rate:.3f}") <= 50


def test_the_terminal_bar_measures_its_rate_from_the_first_update() -> None:
    import io

    from rlhf_batch.runtime.progress import terminal_bar

    clock = iter([0.0, 0.0, 60.0, 60.0, 60.0, 62.0, 62.0, 62.0, 62.0, 62.0])
    bar = terminal_bar(total=10, file=io.StringIO(), mininterval=0, miniters=1)
    bar._time = lambda: next(clock, 62.0)
    bar.start_t = bar.last_print_t = 0.0
    bar.update(1)  # at t = 60: the first unit paid a minute of warm-up
    bar.update(2)  # at t = 62: 2 more units in 2 s
    d = bar.format_dict
    # rate from the first update: (3 - 1) / (62 - 60) = 1 unit/s, so 7 left -> 7 s, where the
    # average since the start, 3 / 62 units/s, would say 7 / (3 / 62) = 144.7 s
    assert d["initial"] == 1 and d["n"] == 3 and d["rate"] is None
    assert (d["n"] - d["initial"]) / d["elapsed"] == 1.0
    bar.close()
