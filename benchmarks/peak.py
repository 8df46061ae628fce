"""Matmul peaks of this machine (GFLOP/s), bf16 and float32, and its memory bandwidth (GB/s,
STREAM-like copy and triad), measured in the same run as the benchmarks; every MFU is relative
to them. Prints one JSON line (and writes it to --out)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, measure_peaks, parser  # noqa: E402

WORKERS = {"peak": lambda spec: measure_peaks(*((512, 1 << 18) if spec.get("tiny") else (2048, 1 << 25)))}


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    tiny = args.tiny or (args.spec is not None and json.loads(args.spec).get("tiny"))
    peaks = measure_peaks(*((512, 1 << 18) if tiny else (2048, 1 << 25)))
    if args.out:
        args.out.write_text(json.dumps(peaks))
    emit(peaks)


if __name__ == "__main__":
    main()
