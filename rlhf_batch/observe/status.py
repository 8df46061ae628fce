"""`rlhf-batch status`: per iteration and stage, complete / stale / partial / missing, rows, timing, the
staleness of the policy that sampled the rollouts and headline numbers (on an SFT or DPO iteration
its objective and the rows it chose), read from the manifests
and the stage folders; train's health (`health ok` or `HEALTH: ...`) on its train row and the
reward_health warning (`REWARD HEALTH: ...`) on the scores row of a flagged iteration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_batch.core.eval_metrics import with_overall
from rlhf_batch.observe.health import reward_warnings
from rlhf_batch.observe.query import connect, existing_run, one_line
from rlhf_batch.sql import sql_text
from rlhf_batch.store import layout, redo
from rlhf_batch.store.manifests import manifest_of, manifests_read_once

STATUS_STAGES = ("rollouts", "scores", "advantages", "train", "eval")  # eval: only where it ran


def print_status(run_dir: str | Path) -> None:
    """Per iteration and stage: complete / stale / partial / missing, rows, start-up and work seconds and
    tokens/s of the run that completed it (its manifest's `timing`), on rollouts rows the
    staleness of their sampling policy (`stale`: 0 in lock-step), and headline numbers."""
    root = existing_run(run_dir)
    n = len(layout.ITER_PREFIX)
    iters = sorted(
        int(p.name[n:]) for p in root.glob(layout.ITER_GLOB) if p.is_dir() and p.name[n:].isdigit()
    )
    if not iters:
        print(f"{root}: no iterations yet")
        return
    mark = redo.read(root)
    with manifests_read_once():  # the views and the rows read the same manifests
        rows = _stale_downstream(_rows(root, iters, mark))
    table = [("iter", "stage", "state", "rows", "startup_s", "work_s", "tok/s", "stale", "details"), *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]  # details: not padded
    print(f"run: {root}")
    if mark is not None:
        print(f"redo from {redo.label(mark)} pending: `rlhf-batch run CONFIG` finishes it")
    for r in table:
        cells = [
            c.ljust(w) if i in (1, 2) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))
        ]
        print("  ".join([*cells, r[-1]]).rstrip())


def _rows(root: Path, iters: list[int], mark: dict[str, Any] | None) -> list[tuple[str, ...]]:
    """`status`'s rows of iterations `iters` (`mark`: a pending `run --redo-from`), read with a few
    queries over the whole run whatever its length, never one per row."""
    con = connect(root)
    try:
        flagged = _reward_warnings(con)
        health = _health(con)  # one query over the run, not one per iteration
        plan = [
            (it, label, _stage_files(root, it, stage, r))
            for it in iters
            for label, stage, r in _status_stages(root, it)
        ]
        headlines = _headlines(con, [files for _, _, files in plan])  # a query per stage, not per row
        rows = [
            (str(it), label, *_stage_status(root, files, head, flagged, health, mark))
            for (it, label, files), head in zip(plan, headlines, strict=True)
        ]
    finally:
        con.close()
    return rows


def _status_stages(root: Path, it: int) -> list[tuple[str, str, int]]:
    """(label, stage folder, top-up round) of the rows `status` shows for iteration `it`: each
    stage, eval only where it ran, and after scores each top-up round's rollouts and scores. The
    iteration after the last (it holds only eval, of the last trained policy) shows eval alone."""
    idir, n = root / layout.iter_name(it), len(layout.TOPUP_PREFIX)
    rounds = sorted(
        int(p.name[n:]) for p in idir.glob(layout.TOPUP_GLOB) if p.is_dir() and p.name[n:].isdigit()
    )
    trained = bool(rounds) or any((idir / s).exists() for s in STATUS_STAGES if s != "eval")
    out = []
    for stage in STATUS_STAGES:
        if (stage != "eval" and trained) or (idir / stage).exists():
            out.append((stage, stage, 0))
        if stage == "scores":
            out += [
                (f"{layout.topup_name(r)}/{s}", s, r)
                for r in rounds
                for s in (layout.ROLLOUTS, layout.SCORES)
            ]
    return out


@dataclass(frozen=True)
class StageFiles:
    """One row of `status`: stage `stage` of iteration `it` (top-up round `topup`), its manifest
    (None: not complete), whether it started, and the Parquet files its headline numbers are
    read from."""

    it: int
    stage: str
    topup: int
    m: dict[str, Any] | None
    started: bool
    files: list[Path]


def _stage_files(root: Path, it: int, stage: str, topup: int = 0) -> StageFiles:
    """What `status` knows of one stage of one iteration before reading its rows: a complete
    stage's parts are its manifest's, a partial one's those on disk, train's its metrics."""
    from rlhf_batch.store import manifests

    sdir = layout.folder(root, it, stage, topup)
    src = manifests.current(sdir)  # its staged copy while a forced run's output is swapped in
    m = manifest_of(src)
    if stage == "train":
        files = [f for f in [src / layout.METRICS_FILE] if f.exists()]
        started = sdir.exists() or layout.policy_dir(root, it).exists()
    else:
        started = sdir.exists()
        files = [src / p["file"] for p in m["parts"]] if m else layout.list_parts(sdir) if started else []
    return StageFiles(it, stage, topup, m, started, files)


HEADLINE_SOURCE = "FROM read_parquet($files, union_by_name = true)"  # of each sql/status_<stage>.sql


def _headline_query(stage: str) -> tuple[str, str]:
    """sql/status_<stage>.sql (the headline numbers of one row's files, `$files`) as two queries
    over the files of many rows: grouped by row (`$rows`: each file's row), and over no row at
    all (what a row whose files hold no row shows: counts 0, the rest null)."""
    text = "\n".join(x for x in sql_text(f"status_{stage}").splitlines() if not x.lstrip().startswith("--"))
    select, sep, rest = text.strip().partition(HEADLINE_SOURCE)
    if not sep or not select.startswith("SELECT") or rest.strip(" ;\n"):
        raise AssertionError(f"sql/status_{stage}.sql: not SELECT ... {HEADLINE_SOURCE}")
    values = select.removeprefix("SELECT")
    grouped = (
        f"SELECT $rows[file_index::BIGINT + 1] AS status_row, {values} {HEADLINE_SOURCE} GROUP BY status_row"
    )
    return grouped, f"SELECT {values} {HEADLINE_SOURCE} WHERE false"


def _headlines(con: Any, rows: list[StageFiles]) -> list[list[str]]:
    """The headline numbers ("name value") of each row: per stage, two queries whatever the
    number of rows: sql/status_<stage>.sql over the files of every row of that stage, grouped by
    row, and over none of their rows (what a row whose files hold no row shows). Where a stage's
    query fails (a damaged file), each of its rows is read on its own, so the damage shows on
    its row alone."""
    import duckdb

    out: list[list[str]] = [[] for _ in rows]
    for stage in STATUS_STAGES:
        mine = [i for i, r in enumerate(rows) if r.stage == stage and r.files]
        if not mine:
            continue
        grouped, empty = _headline_query(stage)
        files = [str(f) for i in mine for f in rows[i].files]
        owner = [i for i in mine for _ in rows[i].files]
        try:
            cur = con.execute(grouped, {"files": files, "rows": owner})
            names = [d[0] for d in cur.description][1:]
            found = {int(r[0]): r[1:] for r in cur.fetchall()}
            nothing = con.execute(empty, {"files": [str(f) for f in rows[mine[0]].files]}).fetchall()[0]
        except duckdb.Error:
            for i in mine:
                out[i] = _headline(con, stage, rows[i].files)
            continue
        for i in mine:
            values = found.get(i, nothing)  # none there: its files hold no row
            out[i] = [f"{k} {_fmt(v)}" for k, v in zip(names, values, strict=True)]
    return out


def _headline(con: Any, stage: str, files: list[Path]) -> list[str]:
    """The headline numbers of one row's files, or why they cannot be read."""
    import duckdb

    try:
        cur = con.execute(sql_text(f"status_{stage}"), {"files": [str(f) for f in files]})
        values = dict(zip([d[0] for d in cur.description], cur.fetchall()[0], strict=True))
        return [f"{k} {_fmt(v)}" for k, v in values.items()]
    except duckdb.Error as e:  # a damaged file must not hide the other stages
        return [f"unreadable ({one_line(e)})"]


def _stage_status(
    root: Path,
    row: StageFiles,
    headline: list[str],
    flagged: dict[int, str],
    health: dict[int, str],
    mark: dict[str, Any] | None = None,
) -> tuple[str, ...]:
    """(state, rows, startup, work, tok/s, stale, details) of one stage of one iteration (of its
    top-up round); `headline`: its numbers (`_headlines`); `flagged`: the reward_health warnings,
    shown on their scores row; `health`: the health view's warning ('' when none) of each trained
    iteration (`_health`); `mark`: a pending `run --redo-from` (store/redo.py), whose stages
    still to redo are stale."""
    from rlhf_batch.store import manifests

    it, stage, topup, m, files = row.it, row.stage, row.topup, row.m, row.files
    state = "complete" if m else "partial" if row.started else "missing"
    details = list(headline)
    if m and (changed := changed_inputs(root, it, stage, topup, m)):
        state = "stale"  # an input was redone since (--force upstream): `run --redo-from` redoes it
        details.insert(0, f"inputs changed since: {', '.join(changed)}")
    if redo.pending(mark, it, redo.folder_stage(stage), m):
        state = "stale"
        details.insert(0, f"redo from {redo.label(mark or {})} pending")
    if stage == "advantages" and m:
        c = m.get("counts", {})
        details.append(f"kept {c.get('groups_out', '?')}/{c.get('groups_total', '?')} groups")
        if m.get("topup_rounds"):
            details.append(f"with top-up rounds {', '.join(map(str, m['topup_rounds']))}")
        details += objective_details(m)
    if stage == "rollouts" and topup and m and (b := m.get("prompt_batch") or {}).get("batch") is not None:
        if "sources" in b:  # a weighted mixture: each source's quota (data/mixtures.py)
            quotas = ", ".join(f"{n} {t['quota']}" for n, t in b["sources"].items())
            details.append(f"prompt batch {b['batch']} (quotas: {quotas})")
        else:
            details.append(
                f"prompt batch {b['batch']} (epoch {b['epoch']}, positions {b['positions'][0]}-{b['positions'][1]})"
            )
    if stage == "rollouts" and m:
        details += trajectory_details(m)
    if stage == "eval" and m:
        details += eval_details(m)
    if stage == "scores" and not topup and m and (warning := flagged.get(it)):
        details.append(f"REWARD HEALTH: {warning}")
    if stage == "train" and m and it in health:
        details.append(f"HEALTH: {health[it]}" if health[it] else "health ok")
    if stage == "train" and m and m.get("objective", "grpo") != "grpo":  # train.objective
        details.insert(0, f"objective {m['objective']}")
    if stage == "train" and (layout.policy_dir(root, it) / "config.json").exists():
        details.append("policy saved")
    elif stage == "train" and (layout.iter_dir(root, it) / layout.POLICY_REMOVED).exists():
        details.append("policy removed (keep_policies)")
    rows = (
        m["rows"]
        if m and stage != "train"
        else sum(manifests.parquet_file(f).metadata.num_rows for f in files)
    )
    stale = str((m or {}).get("staleness", "-")) if stage == "rollouts" else "-"
    return state, str(rows) if files or m else "-", *timing_cells(m), stale, ", ".join(details)


def _reward_warnings(con: Any) -> dict[int, str]:
    """The reward_health view's warnings, per iteration; none when a file it reads is damaged
    (its stage's own line says so)."""
    import duckdb

    try:
        return reward_warnings(con)
    except duckdb.Error:
        return {}


def _stale_downstream(rows: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """A complete stage after a stale one is stale too: later in its iteration, or in any later
    iteration (each starts from the policy trained before it; the eval of iteration K evaluates
    iteration K-1's policy, so a stale stage of K leaves it alone). Redo them all with
    `run --redo-from` from the first stale one."""
    out: list[tuple[str, ...]] = []
    first: tuple[int, str] | None = None  # (iteration, label) of the first stale stage
    for row in rows:
        it, label, state, *rest = row
        if state == "stale" and first is None and label != "eval":
            first = (int(it), label)
        elif state == "complete" and first is not None and (int(it) > first[0] or label != "eval"):
            since = first[1] if int(it) == first[0] else f"{layout.iter_name(first[0])}/{first[1]}"
            details = f"inputs changed since: {since} (stale)"
            row = (it, label, "stale", *rest[:-1], ", ".join(x for x in (details, rest[-1]) if x))
        out.append(row)
    return out


def changed_inputs(root: Path, it: int, stage: str, topup: int, m: dict[str, Any]) -> list[str]:
    """The inputs of a complete stage that are no longer what it read (the run's own folders, as
    the stages fingerprint them): scores' rollouts (their key), advantages' rollouts and scores
    (their manifests' bytes), train's advantages and, after iteration 0, the previous train."""
    from rlhf_batch.store import manifests

    def key(folder: Path) -> Any:
        return (manifest_of(folder) or {}).get("key")

    inputs = m.get("inputs") or {}
    changed = []
    if stage == "scores" and isinstance(r := inputs.get("rollouts"), dict):
        changed += ["rollouts"] * (r.get("key") != key(layout.folder(root, it, "rollouts", topup)))
    if stage == "advantages":
        for name, was in inputs.items():
            path = root / name / layout.MANIFEST
            if name.startswith(layout.ITER_PREFIX) and was != (
                manifests.file_fingerprint(path) if path.exists() else None
            ):
                changed.append(name)
    if stage == "train":
        if "advantages" in inputs and inputs["advantages"] != key(layout.folder(root, it, "advantages")):
            changed.append("advantages")
        if it > 0 and "policy" in inputs and inputs["policy"] != key(layout.folder(root, it - 1, "train")):
            changed.append(f"iter={it - 1:04d}/train")
    return changed


def _health(con: Any) -> dict[int, str]:
    """The health view's warning of each trained iteration ('' where it crossed no threshold)."""
    return {int(it): str(w or "") for it, w in con.execute("SELECT iter, warning FROM health").fetchall()}


def timing_cells(m: dict[str, Any] | None) -> tuple[str, str, str]:
    """Start-up and work seconds and tokens/s of a manifest's `timing`; "-" where it has none."""
    t = (m or {}).get("timing") or {}

    def cell(key: str, spec: str) -> str:
        return "-" if t.get(key) is None else format(t[key], spec)

    return cell("startup_s", ".1f"), cell("work_s", ".1f"), cell("tokens_per_s", ".0f")


def objective_details(m: dict[str, Any]) -> list[str]:
    """An advantages manifest of an SFT or DPO iteration (train.objective): the rows it chose."""
    c = m.get("counts") or {}
    if m.get("objective") == "sft":
        kept = c.get("rows_out", 0) + c.get("rows_not_selected", 0)
        return [f"sft: {c.get('rows_out', 0)} of {kept} rows selected"]
    if m.get("objective") == "dpo":
        return [f"dpo: {c.get('pairs', 0)} pairs from {c.get('groups_paired', 0)} groups"]
    return []


def trajectory_details(m: dict[str, Any]) -> list[str]:
    """A multi-turn rollouts manifest's share of trajectories that ended in env_error, and the
    observations left out for length (none: single-turn rollouts)."""
    c, rows = m.get("counts") or {}, m.get("rows") or 0
    if "env_errors" not in c or not rows:
        return []
    out = [f"env_error {_fmt(c['env_errors'] / rows)}"]
    if c.get("dropped_observations"):
        out.append(f"{c['dropped_observations']} observations dropped for length")
    return out


def eval_details(m: dict[str, Any]) -> list[str]:
    """`source: mean@n x, pass@k y, ...` per data source of an eval manifest."""
    order = ("mean", "pass", "best", "maj")

    def key(name: str) -> tuple[int, int]:
        kind, _, k = name.partition("@")
        return order.index(kind) if kind in order else len(order), int(k) if k.isdigit() else 0

    return [
        f"{source}: " + " ".join(f"{k} {_fmt(values[k])}" for k in sorted(values, key=key) if k != "prompts")
        for source, values in with_overall(m, dedupe=True).items()
    ]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)
