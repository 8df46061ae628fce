"""`report`: PNG plots and one report.html for a run, complete or partial.

Reads only complete stages: scores and rollouts per iteration (with the staleness of the policy
that sampled them, and for multi-turn rollouts the assistant turns per trajectory, the
trajectories an environment failure ended and the seconds spent in the environment, from the
rollouts manifest), the advantage manifests (the
share of groups filtered, and the objective of an SFT or DPO iteration), the train metrics (iter=K/train/metrics.parquet) and the eval
manifests and parts (held-out metrics per data source, example completions), and every stage
manifest's `timing` (start-up and work seconds; top-up rounds added to their stage).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rlhf_batch.core.eval_metrics import with_overall
from rlhf_batch.errors import StageError
from rlhf_batch.observe.health import THRESHOLDS
from rlhf_batch.store import atomic, fs, layout, manifests
from rlhf_batch.store.schemas import EVAL, METRICS, ROLLOUTS, SCORES


def iterations(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("=")[1]) for p in run_dir.glob("iter=[0-9][0-9][0-9][0-9]") if p.is_dir())


def collect(run_dir: Path) -> dict[str, Any]:
    """Per-iteration headline numbers, train metrics by step, and the last scored iteration."""
    per_iter: list[dict[str, Any]] = []
    steps: list[pa.Table] = []
    last = None
    for it in iterations(run_dir):
        row: dict[str, Any] = {"iter": it}
        sdir = layout.folder(run_dir, it, "scores")
        if manifests.manifest(sdir) is not None:
            t = manifests.read_complete(sdir, SCORES, ["score", "reward", "kl_sum"])
            row.update(
                score=_mean(t["score"]),
                score_std=_std(t["score"]),
                reward=_mean(t["reward"]),
                kl=_mean(t["kl_sum"]),
            )
            last = it
        rdir = layout.folder(run_dir, it, "rollouts")
        if (rm := manifests.manifest(rdir)) is not None:
            row["staleness"] = rm.get("staleness")  # of the sampling policy (None: not recorded)
            lengths = pc.list_value_length(
                manifests.read_complete(rdir, ROLLOUTS, ["response_ids"])["response_ids"]
            )
            row["length"] = _mean(lengths)
            row.update(_turns(rm))
        adv = manifests.manifest(layout.folder(run_dir, it, "advantages"))
        if adv is not None:
            c = adv.get("counts", {})
            total = c.get("groups_total", 0)
            dropped = c.get("groups_dropped_zero_variance", 0) + c.get("groups_dropped_small", 0)
            row["filtered"] = dropped / total if total else None
            if adv.get("objective", "grpo") != "grpo":  # train.objective: what trained it
                row["objective"] = adv["objective"]
        metrics = layout.folder(run_dir, it, layout.TRAIN) / layout.METRICS_FILE
        if metrics.exists() and manifests.manifest(metrics.parent) is not None:
            m = manifests.read_part(metrics, METRICS)
            steps.append(m.append_column("iter", pa.array([it] * m.num_rows, pa.int32())))
        ev = manifests.manifest(layout.folder(run_dir, it, layout.EVAL))
        if ev is not None:
            row["eval"] = with_overall(ev, dedupe=True)
        if time := _stage_times(run_dir, it):
            row["time"] = time
        per_iter.append(row)
    steps_table = pa.concat_tables(steps, promote_options="default") if steps else None  # LATER_COLUMNS
    return {"iters": per_iter, "steps": steps_table, "last": last}


def _stage_times(run_dir: Path, it: int) -> dict[str, dict[str, float]]:
    """Start-up and work seconds per stage folder of iteration `it` whose manifest records them,
    its top-up rounds' generate and score added to rollouts and scores."""
    out: dict[str, dict[str, float]] = {}
    it_dir = layout.iter_dir(run_dir, it)
    for sdir in [*(it_dir / f for f in layout.FOLDERS), *sorted(it_dir.glob(f"{layout.TOPUP_GLOB}/*"))]:
        timing = (manifests.manifest(sdir) or {}).get("timing") or {}
        if timing.get("startup_s") is None or timing.get("work_s") is None:
            continue  # not complete, or written before stages recorded their time
        t = out.setdefault(sdir.name, {"startup_s": 0.0, "work_s": 0.0})
        t["startup_s"] += timing["startup_s"]
        t["work_s"] += timing["work_s"]
    return out


TURN_KEYS = ("turns", "env_errors", "env_s")  # per iteration, multi-turn rollouts only


def _turns(manifest: dict[str, Any]) -> dict[str, Any]:
    """Assistant turns per trajectory, trajectories an environment failure ended, and seconds
    spent in environment calls, from a multi-turn rollouts manifest ({} for single-turn)."""
    c, rows = manifest.get("counts", {}), manifest.get("rows") or 0
    if "turns" not in c:
        return {}
    return {
        "turns": c["turns"] / rows if rows else None,
        "env_errors": int(c.get("env_errors", 0)),
        "env_s": c.get("env_milliseconds", 0) / 1000,
    }


def _mean(col: Any) -> float | None:
    return pc.mean(col).as_py()


def _std(col: Any) -> float | None:
    return pc.stddev(col, ddof=1).as_py() if pc.count(col).as_py() > 1 else None


def write_report(
    run_dir: Path | str, out: Path | None = None, *, tensorboard: bool = False, n_examples: int = 5
) -> Path:
    run_dir = fs.run_path(run_dir)
    if not run_dir.is_dir():
        raise StageError(f"{run_dir}: run directory not found")
    out = fs.run_path(out) if out else run_dir / layout.REPORT_DIR
    if out.exists() and not out.is_dir():
        raise StageError(f"--out {out}: is a file; the report needs a directory")
    try:
        fs.makedirs(out)
    except OSError as e:
        raise StageError(f"--out {out}: cannot make the folder ({e.strerror or e})") from None
    data = collect(run_dir)
    data["health"], data["mismatch"] = _health(run_dir, data["iters"])
    plots = _plots(data, out)
    examples = _examples(run_dir, data["last"], n_examples) if data["last"] is not None else []
    plots += _eval_plot(data, out) + _time_plot(data, out)
    completions = _eval_examples(run_dir, data, n_examples)
    page = out / layout.REPORT_PAGE
    atomic.write_json_atomic(out / layout.REPORT_SUMMARY, data["iters"])
    html = _html(run_dir, data, plots, examples).replace("</body>", _eval_html(completions) + "</body>")
    atomic.write_file_atomic(page, lambda tmp: tmp.write_text(html))
    if tensorboard:
        _tensorboard(data, out / "tensorboard")
    return page


# the rollouts whose trainer log-probs differ most from their behaviour log-probs (rollout_stats)
MISMATCH_SQL = """
SELECT s.iter, s.rollout_id, s.epoch, s.logprob_diff_max, s.ratio_max, s.is_weight, s.masked_tokens,
       r.response
FROM rollout_stats s LEFT JOIN rollouts r ON r.rollout_id = s.rollout_id
ORDER BY s.logprob_diff_max DESC, s.iter, s.rollout_id, s.epoch LIMIT ?
"""


def _health(run_dir: Path, rows: list[dict[str, Any]], n: int = 5) -> tuple[list[dict[str, Any]], ...]:
    """The health view's rows (each iteration's flags also go into its row: summary.json), and the
    `n` rollouts of largest trainer/behaviour mismatch."""
    from rlhf_batch.observe.health import rows as health_rows
    from rlhf_batch.observe.query import connect

    con = connect(run_dir)
    try:
        found = health_rows(con)
        cur = con.execute(MISMATCH_SQL, [n])
        names = [d[0] for d in cur.description]
        mismatch = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    finally:
        con.close()
    flags = {r["iter"]: r["flags"] for r in found}
    for row in rows:
        if row["iter"] in flags:
            row["health"] = flags[row["iter"]]
    return found, mismatch


def _plots(data: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, names = data["iters"], []

    def series(key: str) -> tuple[list[int], list[float]]:
        pts = [(r["iter"], r[key]) for r in rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        atomic.write_file_atomic(out / name, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
        plt.close(fig)
        names.append(name)

    for key, title, name in [
        ("score", "mean score (band: ±1 std)", "reward.png"),
        ("kl", "mean KL per rollout", "kl.png"),
        ("length", "mean response length (tokens)", "length.png"),
        ("filtered", "share of groups filtered", "filtered.png"),
    ]:
        x, y = series(key)
        if not x:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot(x, y, marker="o")
        if key == "score":
            band = [r for r in rows if r.get("score") is not None and r.get("score_std") is not None]
            ax.fill_between(
                [r["iter"] for r in band],
                [r["score"] - r["score_std"] for r in band],
                [r["score"] + r["score_std"] for r in band],
                alpha=0.2,
            )
            rx, ry = series("reward")
            ax.plot(rx, ry, marker=".", linestyle="--", label="reward (after KL)")
            ax.legend()
        ax.set(title=title, xlabel="iteration")
        whole_ticks(ax, x)
        save(fig, name)
    steps = data["steps"]
    if steps is not None and steps.num_rows:
        fig, axes = plt.subplots(2, 4, figsize=(14, 6.2))
        x = list(range(steps.num_rows))
        for ax, key in zip(axes.flat, TRAIN_PANELS, strict=False):
            ax.plot(x, [float("nan") if v is None else v for v in steps[key].to_pylist()])  # null: no row ran
            ax.set(title=key, xlabel="train step (all iterations)")
            if key in THRESHOLDS:  # the health threshold (health.py)
                ax.axhline(THRESHOLDS[key], color="red", linestyle=":", linewidth=1)
            ax.ticklabel_format(axis="y", useOffset=False)  # ESS near 1: 0.9999, not "+1" and 1e-5 ticks
            whole_ticks(ax, x)
        for ax in list(axes.flat)[len(TRAIN_PANELS) :]:
            ax.set_visible(False)
        save(fig, "train.png")
    return names


TRAIN_PANELS = ("loss", "grad_norm", "lr", "clip_fraction", "entropy", "ess", "kl_approx")


def whole_ticks(ax: Any, xs: list[int]) -> None:
    """Iterations and steps are whole numbers: no 0.5 ticks on their axis (a few x values: each
    one is a tick; more: whole-number ticks chosen by matplotlib)."""
    from matplotlib.ticker import FixedLocator, MaxNLocator

    values = sorted(set(xs))
    few = 0 < len(values) <= 12
    ax.xaxis.set_major_locator(FixedLocator(values) if few else MaxNLocator(integer=True))


def _examples(run_dir: Path, it: int, n: int) -> list[dict[str, Any]]:
    scores = manifests.read_complete(layout.folder(run_dir, it, "scores"), SCORES, ["rollout_id", "score"])
    rollouts = manifests.read_complete(
        layout.folder(run_dir, it, "rollouts"), ROLLOUTS, ["rollout_id", "prompt", "response"]
    )
    joined = rollouts.join(scores, "rollout_id").filter(pc.is_valid(pc.field("score")))
    ordered = joined.sort_by([("score", "descending"), ("rollout_id", "ascending")]).to_pylist()
    best, worst = ordered[:n], ordered[-n:][::-1] if len(ordered) > n else []
    return [{"kind": "best", **r} for r in best] + [{"kind": "worst", **r} for r in worst]


def _eval_plot(data: dict[str, Any], out: Path) -> list[str]:
    """eval.png: one panel per data source, mean@n and pass@k (each k) by iteration."""
    rows = [r for r in data["iters"] if r.get("eval")]
    sources = sorted({s for r in rows for s in r["eval"]})
    if not sources:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sources), figsize=(5 * len(sources), 3.2), squeeze=False)
    for ax, source in zip(axes[0], sources, strict=True):
        pts = [(r["iter"], r["eval"][source]) for r in rows if source in r["eval"]]
        keys = sorted({k for _, m in pts for k in m if k.startswith(("mean@", "pass@"))}, key=_metric_order)
        for i, key in enumerate(keys):  # lines that coincide stay visible: hollow, shrinking markers
            xy = [(it, m[key]) for it, m in pts if key in m]
            ax.plot(
                [p[0] for p in xy],
                [p[1] for p in xy],
                marker="osD^v<>"[i % 7],
                markersize=max(3.0, 10.0 - 2.0 * i),
                markerfacecolor="none" if i else None,
                linestyle=("-", "--", ":", "-.")[i % 4],
                label=key,
            )
        ax.set(title=f"held-out: {source}", xlabel="iteration (policy it starts from)")
        whole_ticks(ax, [it for it, _ in pts])
        ax.legend(fontsize="small")
    fig.tight_layout()
    atomic.write_file_atomic(out / "eval.png", lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    plt.close(fig)
    return ["eval.png"]


BARS_UP_TO = 200  # iterations: past them time.png stacks areas (a bar is a patch: 8 an iteration)


def _time_plot(data: dict[str, Any], out: Path) -> list[str]:
    """time.png: one bar per iteration, stacked by stage, each stage's start-up (light, hatched)
    under its work (full colour); past BARS_UP_TO iterations, where a bar is narrower than a
    pixel, each layer is one area stepped per iteration (seconds less to draw on a long run)."""
    rows = [r for r in data["iters"] if r.get("time")]
    if not rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = [r["iter"] for r in rows]
    bottom = [0.0] * len(rows)
    legend = []
    for k, stage in enumerate(layout.FOLDERS):
        color = f"C{k}"
        for part in ("startup_s", "work_s"):
            h = [r["time"].get(stage, {}).get(part, 0.0) for r in rows]
            if any(h):
                light = part == "startup_s"
                look: dict[str, Any] = {
                    "color": color,
                    "alpha": 0.35 if light else 1.0,
                    "hatch": "//" if light else None,
                }
                top = [b + v for b, v in zip(bottom, h, strict=True)]
                if len(rows) <= BARS_UP_TO:
                    ax.bar(x, h, 0.7, bottom, **look)
                else:
                    ax.fill_between(x, bottom, top, step="mid", linewidth=0, **look)
                bottom = top
        if any(stage in r["time"] for r in rows):
            legend.append(Patch(color=color, label=stage))
    legend.append(Patch(facecolor="white", edgecolor="grey", hatch="//", label="start-up"))
    ax.set(title="time per stage: start-up (hatched) and work", xlabel="iteration", ylabel="seconds")
    whole_ticks(ax, x)
    ax.set_xlim(min(x) - 0.6, max(x) + 0.6)
    ax.set_ylim(0, max(bottom) * 1.08 or 1.0)  # the tallest stack with room above it
    ax.legend(handles=legend, fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    atomic.write_file_atomic(out / "time.png", lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    plt.close(fig)
    return ["time.png"]


def _metric_order(key: str) -> tuple[str, int]:
    name, _, k = key.partition("@")
    return name, int(k) if k.isdigit() else 0


def _eval_examples(run_dir: Path, data: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Per evaluated iteration, the first sample of the first `n` held-out prompts (file order, the
    same prompts at every iteration) with its reward."""
    out = []
    for r in data["iters"]:
        if "eval" not in r:
            continue
        t = manifests.read_complete(
            layout.folder(run_dir, r["iter"], layout.EVAL),
            EVAL,
            ["prompt_id", "sample_idx", "prompt", "response", "reward", "correct"],
        )
        first = t.filter(pc.equal(t["sample_idx"], 0)).slice(0, n).to_pylist()
        out += [{"iter": r["iter"], **row} for row in first]
    return out


def _eval_html(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""

    def reward(v: float | None) -> str:
        return "" if v is None else f"{v:.4g}"

    body = "".join(
        f"<tr><td>{e['iter']}</td><td>{html.escape(e['prompt_id'])}</td><td>{reward(e['reward'])}</td>"
        f"<td>{e['correct']}</td><td><pre>{html.escape(e['prompt'])}</pre></td>"
        f"<td><pre>{html.escape(e['response'])}</pre></td></tr>"
        for e in rows
    )
    return (
        "<h2>Held-out completions by iteration (sample 0 of the first prompts)</h2>"
        "<table><tr><th>iter</th><th>prompt_id</th><th>reward</th><th>correct</th><th>prompt</th>"
        f"<th>response</th></tr>{body}</table>\n"
    )


def _html(run_dir: Path, data: dict[str, Any], plots: list[str], examples: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        return "" if v is None else f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))

    keys = ["iter", "staleness", "score", "reward", "kl", "length", "filtered"]
    keys += [k for k in TURN_KEYS if any(k in r for r in data["iters"])]  # multi-turn runs
    if any("objective" in r for r in data["iters"]):  # SFT or DPO iterations: the objective of each
        keys.append("objective")

    def value(r: dict[str, Any], k: str) -> Any:  # an iteration with advantages and no objective: grpo
        return r.get(k, "grpo" if k == "objective" and "filtered" in r else None)

    table = "".join(
        "<tr>" + "".join(f"<td>{cell(value(r, k))}</td>" for k in keys) + "</tr>" for r in data["iters"]
    )
    ex = "".join(
        f"<tr><td>{e['kind']}</td><td>{cell(e['score'])}</td><td><pre>{html.escape(e['prompt'])}</pre></td>"
        f"<td><pre>{html.escape(e['response'])}</pre></td></tr>"
        for e in examples
    )
    imgs = "".join(f'<img src="{p}" alt="{p}">' for p in plots)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>rlhf-batch report</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{border:1px solid #ccc;padding:4px}}
table{{border-collapse:collapse}}pre{{margin:0;white-space:pre-wrap}}img{{margin:4px}}</style></head><body>
<h1>rlhf-batch report</h1><p>{html.escape(str(run_dir))}</p>
<h2>By iteration</h2><table><tr>{"".join(f"<th>{k}</th>" for k in keys)}</tr>{table}</table>
<h2>Health</h2>{_health_html(data["health"])}
<h2>Largest trainer/behaviour mismatch</h2>{_mismatch_html(data["mismatch"], cell)}
<h2>Plots</h2>{imgs or "<p>nothing to plot yet</p>"}
<h2>Best and worst responses (iteration {data["last"]})</h2>
<table><tr><th></th><th>score</th><th>prompt</th><th>response</th></tr>{ex}</table></body></html>
"""


def _mismatch_html(rows: list[dict[str, Any]], cell: Any) -> str:
    """The rollouts of largest max |trainer - behaviour log-prob| (the rollout_stats view)."""
    if not rows:
        return "<p>no per-rollout train diagnostics yet</p>"
    keys = ["iter", "rollout_id", "epoch", "logprob_diff_max", "ratio_max", "is_weight", "masked_tokens"]
    body = "".join(
        "<tr>" + "".join(f"<td>{cell(r[k])}</td>" for k in keys)
        + f"<td><pre>{html.escape(r['response'] or '')}</pre></td></tr>"
        for r in rows
    )  # fmt: skip
    return f"<table><tr>{''.join(f'<th>{k}</th>' for k in [*keys, 'response'])}</tr>{body}</table>"


def _health_html(rows: list[dict[str, Any]]) -> str:
    """The flagged iterations (docs/inspecting.md "Run health": the thresholds and their sources)."""
    flagged = [r for r in rows if r["flags"]]
    if not flagged:
        return f"<p>no iteration crossed a threshold ({len(rows)} trained)</p>"
    body = "".join(
        f"<tr><td>{r['iter']}</td><td>{', '.join(r['flags'])}</td><td>{html.escape(r['warning'])}</td></tr>"
        for r in flagged
    )
    head = f"<p>{len(flagged)} of {len(rows)} trained iterations crossed a threshold</p>"
    return f"{head}<table><tr><th>iter</th><th>flags</th><th>what crossed</th></tr>{body}</table>"


def _tensorboard(data: dict[str, Any], logdir: Path) -> None:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise StageError(
            f"--tensorboard needs the tensorboard package ({e}); pip install tensorboard"
        ) from None
    w = SummaryWriter(str(logdir))
    for r in data["iters"]:
        for key in ("score", "reward", "kl", "length", "filtered"):
            if r.get(key) is not None:
                w.add_scalar(f"iteration/{key}", r[key], r["iter"])
        for source, values in r.get("eval", {}).items():
            for key, v in values.items():
                w.add_scalar(f"eval/{source}/{key}", v, r["iter"])
    steps = data["steps"]
    if steps is not None:
        for i, row in enumerate(steps.to_pylist()):
            for key in ("loss", "clip_fraction", "entropy", "ess", "kl_approx", "grad_norm"):
                if row[key] is not None:  # null: the step ran no row
                    w.add_scalar(f"train/{key}", row[key], i)
    w.close()
