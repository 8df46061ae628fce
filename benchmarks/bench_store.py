"""advantage on a run directory in an object store against the same run on local disk.

Data: the synthetic complete rollouts + scores stages of bench_advantage.py (N rows, 8 per
prompt, written in 1M-row parts), written once to a local run directory and once to
`s3://BUCKET/run` on an S3-protocol server (moto's, tests/s3server.py) started on 127.0.0.1 by
this script. Measured: the whole advantage stage (`run_stage("advantage", ...)`: listing, manifests, Parquet
footers and schema checks, DuckDB reading the parts through the fsspec filesystem, sorting,
writing the training parts to the same store), each in a fresh worker process, local and store
alternately, `ROUNDS` times each; the figures are the fastest of each. Target: the store within 2x
of local disk on the loopback server. Needs the moto server (`make s3`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_advantage  # noqa: E402
import common  # noqa: E402
from common import append_row, emit  # noqa: E402

from rlhf_batch.stages.registry import run_stage

ROUNDS = 2


def worker_stage(spec: dict[str, Any]) -> dict[str, Any]:

    t0 = time.perf_counter()
    m = run_stage("advantage", bench_advantage.config(spec["run_dir"]), 0, force=True, quiet=True)
    return {"seconds": time.perf_counter() - t0, "rows_out": m["rows"]}


def worker_write(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    bench_advantage.write_data(spec["run_dir"], spec["rows"])
    return {"seconds": time.perf_counter() - t0}


WORKERS = {"stage": worker_stage, "write": worker_write}


def measure(local: str, remote: str, rows: int, tiny: bool) -> tuple[list[dict], list[dict]]:
    """Write both inputs, then run the stage on each, alternately, ROUNDS times."""
    for d in (local, remote):
        common.run_worker("bench_store.py", "write", {"run_dir": d, "rows": rows, "tiny": tiny})
    times: tuple[list[dict], list[dict]] = ([], [])
    for _ in range(1 if tiny else ROUNDS):
        for d, out in zip((local, remote), times, strict=True):
            out.append(common.run_worker("bench_store.py", "stage", {"run_dir": d, "tiny": tiny}))
    return times


def main() -> None:
    args = common.parser(__doc__ or "").parse_args()
    if args.worker:
        emit(WORKERS[args.worker](json.loads(args.spec)))
        return
    sys.path.insert(0, str(common.ROOT))
    from tests.s3server import S3Server, new_bucket

    rows = 20_000 if args.tiny else 1_000_000
    server = S3Server()
    server.start()
    old = dict(os.environ)
    os.environ.update(server.env())  # the workers inherit the endpoint and the test credentials
    common.CACHE.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=common.CACHE) as tmp:
            remote = f"s3://{new_bucket(server)}/run"
            loc, rem = measure(str(Path(tmp) / "run"), remote, rows, args.tiny)
    finally:
        os.environ.clear()
        os.environ.update(old)
        server.stop()
    t_loc, t_rem = min(r["seconds"] for r in loc), min(r["seconds"] for r in rem)
    assert loc[0]["rows_out"] == rem[0]["rows_out"]
    every = ", ".join(f"{a['seconds']:.1f}s / {b['seconds']:.1f}s" for a, b in zip(loc, rem, strict=True))
    append_row(
        args.results,
        "advantage on an object store",
        f"{rows:,} rollouts, 8 per prompt, in 1M-row parts -> {rem[0]['rows_out']:,} training rows; "
        f"store: moto S3 server on 127.0.0.1 via s3fs; fresh process per run, local / store: {every}",
        "seconds, whole stage (store = ours, local disk = baseline)",
        f"{t_rem:.2f}s",
        f"{t_loc:.2f}s",
        f"{t_rem / t_loc:.2f}x",
        target="<= 2x of local disk",
        met=t_rem <= 2 * t_loc,
    )


if __name__ == "__main__":
    main()
