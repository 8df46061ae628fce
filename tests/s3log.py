"""moto's S3 server with a request log: every request it answers is one JSON line in LOG (method,
path, query, status, bytes received and sent, requests in flight when it arrived), written before the answer leaves, so a client
that has its answer finds the line there. Counted on the server, so requests of child processes
(stage commands) count as well as the caller's. With `--latency-file`, each request waits the
milliseconds that file holds (while it exists) before it is answered: a store across a network,
for benchmarks (`S3Server.set_latency`). Run by .venv-s3's Python (tests/s3server.py
starts it with `S3Server(log=...)`): `python tests/s3log.py -p PORT --log LOG`."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any


def counting(app: Any, log_path: str, latency_file: str | None = None) -> Any:
    """`app` (a WSGI application) with every request appended to `log_path` as one JSON line,
    each answered after the milliseconds in `latency_file` when it exists."""
    lock = threading.Lock()
    out = open(log_path, "a", buffering=1)  # noqa: SIM115 - open for the server's life
    busy = [0]  # requests being answered now

    def wrapped(environ: dict[str, Any], start_response: Any) -> Any:
        status: list[str] = []
        with lock:
            busy[0] += 1
            inflight = busy[0]  # this one and those under way when it arrived

        def start(s: str, headers: Any, exc_info: Any = None) -> Any:
            status.append(s)
            return start_response(s, headers, exc_info)

        try:
            if latency_file and (wait := Path(latency_file)).exists():
                time.sleep(float(wait.read_text() or 0) / 1000)
            body = list(app(environ, start))  # whole: the line is written before the answer is sent
        finally:
            with lock:
                busy[0] -= 1
        line = {
            "method": environ["REQUEST_METHOD"],
            "path": environ.get("PATH_INFO", ""),
            "query": environ.get("QUERY_STRING", ""),
            "status": int(status[0].split()[0]) if status else 0,
            "in": int(environ.get("CONTENT_LENGTH") or 0),
            "inflight": inflight,
            "out": 0 if environ["REQUEST_METHOD"] == "HEAD" else sum(len(b) for b in body),
        }
        with lock:
            out.write(json.dumps(line) + "\n")
            out.flush()
        return body

    return wrapped


def main() -> None:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    p = argparse.ArgumentParser()
    p.add_argument("-H", "--host", default="127.0.0.1")
    p.add_argument("-p", "--port", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--latency-file")
    args = p.parse_args()
    app = counting(DomainDispatcherApplication(create_backend_app), args.log, args.latency_file)
    run_simple(args.host, args.port, app, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
