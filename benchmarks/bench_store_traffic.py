"""Store traffic of a run on an object store: requests and bytes, counted on the server.

An S3-protocol server (moto's, tests/s3server.py, behind the counting layer of tests/s3log.py)
runs on 127.0.0.1; every request it answers is a line of its log, so requests of child processes
(stage commands, `run`'s stages) count too. The workload is pipelines/demo.toml for ITERATIONS
iterations with `run_dir = s3://BUCKET/run`, `policy_model = s3://BUCKET/models/policy` (the
policy on the store, as on several machines), the prompts in a local file, and one model cache
(RLHF_BATCH_CACHE) per pass: one node. Two passes, each on a fresh bucket and cache:

- `run`: the `run` command as the demo runs it (`in_process = true`);
- `stages`: the stage commands one process each, as a scheduler runs them (`generate`, `score`,
  `advantage`, `train` per iteration, each counted alone).

Then over the `run` pass's finished run: `status`, `sql` with one query over scores, and iteration
0's advantage redone (`--force`) in parts of 2 rows, twice with its parts uploaded one at a time
(RLHF_BATCH_UPLOADS=0) and twice in the background (the default), alternating, with every
request answered LATENCY_MS late (a store across a network, not on this machine). For each:
requests (by method; listings are GETs with `list-type`), bytes sent and received, and the bytes
of model downloads (GETs of objects in a policy folder: the initial policy, iter=K/policy).
Counts, not times: they do not depend on the machine's load. Rows go to benchmarks/results.md,
the figures to benchmarks/results/store_traffic.json under `--label` (before/after a change).
Needs the moto server (`make s3`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import append_row  # noqa: E402

ITERATIONS = 2
UPLOADERS = 8  # store/fs.py's default
LATENCY_MS = 20  # each request's wait in the part-upload comparison: a store in the same region
STAGES = ("generate", "score", "advantage", "train")
OUT = common.HERE / "results" / "store_traffic.json"
DEMO = common.ROOT / "pipelines" / "demo.toml"


def summary(reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests by kind, bytes each way, and bytes of model (policy folder) downloads."""
    by: dict[str, int] = {}
    for r in reqs:
        kind = "LIST" if r["method"] == "GET" and "list-type" in r["query"] else r["method"]
        by[kind] = by.get(kind, 0) + 1
    model = [r for r in reqs if r["method"] == "GET" and "/policy/" in r["path"] and r["status"] < 300]
    return {
        "requests": len(reqs),
        "by_method": dict(sorted(by.items())),
        "bytes_sent": sum(r["in"] for r in reqs),
        "bytes_received": sum(r["out"] for r in reqs),
        "model_downloads": len(model),
        "model_bytes": sum(r["out"] for r in model),
        # the most requests the server was answering at once when an upload arrived (1: one at a time)
        "max_puts_in_flight": max((r.get("inflight", 1) for r in reqs if r["method"] == "PUT"), default=0),
        "part_puts": len(parts := [r for r in reqs if r["method"] == "PUT" and "/part-" in r["path"]]),
        "max_part_puts_in_flight": max((r.get("inflight", 1) for r in parts), default=0),
    }


class Counter:
    """Phases of work against one server: the requests its log gained during each."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.phases: dict[str, dict[str, Any]] = {}

    def run(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        before = len(self.server.requests())
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=common.ROOT, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        reqs = self.server.requests()[before:]
        self.phases[name] = {**summary(reqs), "seconds": round(time.perf_counter() - t0, 1)}
        print(f"# {name}: {self.phases[name]}", flush=True)


def setup(server: Any, tmp: Path, name: str) -> tuple[str, list[str], dict[str, str]]:
    """A fresh bucket with the demo policy on it, a local prompt file, a fresh model cache: the
    run directory, the `--set`s of the run and the environment of its commands."""
    import s3fs

    from rlhf_batch.data.demo import write_prompts
    from rlhf_batch.models.tiny import init_model
    from tests.s3server import CREDENTIALS, new_bucket

    bucket = new_bucket(server)
    model = init_model(tmp / name / "policy", seed=0)
    prompts = write_prompts(tmp / name / "prompts.jsonl", 256, seed=0)
    fsys = s3fs.S3FileSystem(
        key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=server.endpoint,
        skip_instance_cache=True,
    )
    fsys.put(f"{model}/", f"{bucket}/models/policy/", recursive=True)
    sets = {
        "run_dir": f"s3://{bucket}/run",
        "policy_model": f"s3://{bucket}/models/policy",
        "generate.prompts": str(prompts),
        "iterations": str(ITERATIONS),
        "demo": "false",
    }
    env = {**os.environ, **server.env(), "RLHF_BATCH_CACHE": str(tmp / name / "cache")}
    env["PYTHONPATH"] = os.pathsep.join([str(common.ROOT), env.get("PYTHONPATH", "")])
    return sets["run_dir"], [x for k, v in sets.items() for x in ("--set", f"{k}={v}")], env


def measure(tiny: bool) -> dict[str, Any]:
    from tests.s3server import S3Server

    global ITERATIONS
    ITERATIONS = 1 if tiny else ITERATIONS
    cli = [sys.executable, "-m", "rlhf_batch"]
    with tempfile.TemporaryDirectory(dir=common.CACHE) as d:
        tmp = Path(d)
        server = S3Server(log=tmp / "requests.jsonl")
        server.start()
        try:
            count = Counter(server)
            run_dir, sets, env = setup(server, tmp, "run")
            count.run("run", [*cli, "run", str(DEMO), *sets, "--quiet"], env)
            count.run("status", [*cli, "status", run_dir], env)
            query = "SELECT iter, count(*) AS n, avg(score) AS mean FROM scores GROUP BY iter ORDER BY iter"
            count.run("sql", [*cli, "sql", "--run-dir", run_dir, "--format", "csv", query], env)
            # parts uploaded one at a time (RLHF_BATCH_UPLOADS=0) or in the background, side by
            # side, alternating, each request answered LATENCY_MS late (a store across a network):
            # iteration 0's advantage redone in parts of 2 rows
            server.set_latency(LATENCY_MS)
            forced = [*cli, "advantage", str(DEMO), "--iter", "0", *sets, "--force", "--quiet"]
            forced += ["--set", "advantage.rows_per_part=2"]
            count.run("parts/first", forced, env)  # the parts' size changes: not compared
            for rep in range(2):
                for depth in ("0", str(UPLOADERS)):
                    count.run(f"parts/uploads={depth}/{rep}", forced, {**env, "RLHF_BATCH_UPLOADS": depth})
            server.set_latency(0)
            _, sets, env = setup(server, tmp, "stages")
            for it in range(ITERATIONS):
                for stage in STAGES:
                    cmd = [*cli, stage, str(DEMO), "--iter", str(it), *sets, "--quiet"]
                    count.run(f"stages/iter={it}/{stage}", cmd, env)
        finally:
            server.stop()
    return {"iterations": ITERATIONS, "phases": count.phases}


def rows(results: Path, label: str, m: dict[str, Any]) -> None:
    n, ph = m["iterations"], m["phases"]
    work = (
        f"pipelines/demo.toml, {n} iteration(s), run_dir and policy on moto's S3 server on 127.0.0.1, "
        f"counted on the server; {label}"
    )
    stage = {s: [ph[f"stages/iter={i}/{s}"] for i in range(n)] for s in STAGES}
    per_stage = ", ".join(f"{s} {sum(p['requests'] for p in v) / n:.0f}" for s, v in stage.items())
    append_row(results, "store requests: run", work, "requests per iteration (run, in_process)",
               f"{ph['run']['requests'] / n:.0f}")  # fmt: skip
    append_row(results, "store requests: stage commands", work, f"requests per iteration ({per_stage})",
               f"{sum(sum(p['requests'] for p in v) for v in stage.values()) / n:.0f}")  # fmt: skip
    for what in ("status", "sql"):
        append_row(results, f"store requests: {what}", work, f"requests, over {n} iteration(s)",
                   str(ph[what]["requests"]))  # fmt: skip
    model = sum(sum(p["model_bytes"] for p in v) for v in stage.values()) / n
    append_row(results, "store model downloads", work,
               f"bytes of policy downloads per node and iteration, stage commands (run: "
               f"{ph['run']['model_bytes'] / n:,.0f})", f"{model:,.0f}")  # fmt: skip
    for depth in ("0", str(UPLOADERS)):
        runs = [ph[k] for k in ph if k.startswith(f"parts/uploads={depth}/")]
        append_row(results, f"store part uploads: RLHF_BATCH_UPLOADS={depth}", work,
                   f"advantage --force, {runs[0]['part_puts']} part uploads of 2 rows, each request "
                   f"{LATENCY_MS} ms late: seconds (best of "
                   f"{len(runs)}), most part uploads at once {max(r['max_part_puts_in_flight'] for r in runs)}",
                   f"{min(r['seconds'] for r in runs)}")  # fmt: skip
    puts = max(p["max_puts_in_flight"] for p in stage["train"])
    append_row(results, "store uploads at once", work,
               "most requests in flight at an upload of train (its policy folder)", str(puts))  # fmt: skip


def main() -> None:
    p = common.parser(__doc__ or "")
    p.add_argument("--label", default="now", help="the key of these figures in results/store_traffic.json")
    args = p.parse_args()
    sys.path.insert(0, str(common.ROOT))
    common.CACHE.mkdir(parents=True, exist_ok=True)
    m = measure(args.tiny)
    m.update(date=time.strftime("%Y-%m-%d %H:%M"), machine=common.machine(), load=common.loadavg())
    rows(args.results, args.label, m)
    if not args.tiny:
        saved = json.loads(OUT.read_text()) if OUT.exists() else {}
        saved[args.label] = m
        OUT.write_text(json.dumps(saved, indent=1) + "\n")


if __name__ == "__main__":
    main()
