"""`make wheels`: the project and its runtime dependencies as wheels, for a GPU machine without a
network where a CUDA PyTorch is already installed (benchmarks/gpu_check.py installs from them).

The dependencies are the closure of rlhf-batch's own requirements (no extras) as this venv has
them installed, at the versions constraints.txt pins (the installed one for a package it does not
pin), without torch and what only torch needs
(nvidia-*, triton, ...): the GPU machine's torch stays. They are downloaded for the GPU machine's
Python and platform (`--python-version`, `--platform`), binary wheels only. `--have FILE` (the
GPU machine's `python -m pip list --format=freeze`, or its package names one per line) leaves out
what that machine already has at a version the closure accepts (a bare name counts as accepted):
pip installs only what is missing there. `--also NAME==VERSION ...` adds other versions to offer
beside the pins, for a machine whose packages the pinned versions may not fit (pip picks the newest
that fits what is installed).

    make wheels                                        # wheels/ for CPython 3.11 on x86-64 Linux
    .venv/bin/python benchmarks/gpu_wheels.py --out wheels --python-version 3.12 --have gpu-freeze.txt
    .venv/bin/python benchmarks/gpu_wheels.py --list   # the pins, nothing downloaded
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LEFT_OUT = {"torch"}  # the GPU machine's own (and, through it, nvidia-*, triton, ...)
PLATFORMS = [
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_34_x86_64",
]


def constraints() -> dict[str, str]:
    """constraints.txt's pins, by canonical name."""
    lines = [line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line]
    return {canonicalize_name(name): version for name, version in lines}


def closure(
    root: str = "rlhf-batch", python_version: str = "3.11", have: dict[str, str | None] | None = None
) -> dict[str, str]:
    """{distribution name: version} of everything `root` needs at run time (the requirements of
    what this venv has installed, markers evaluated for `python_version` on Linux), not descending
    into LEFT_OUT; the version constraints.txt pins, else the installed one. Without what `have`
    (name: version or None) holds at a version every requirement on it accepts."""
    pinned = constraints()
    specs: dict[str, list] = {}
    have = have or {}
    env = {"python_version": python_version, "python_full_version": f"{python_version}.0"}
    env |= {"sys_platform": "linux", "platform_system": "Linux", "extra": ""}
    out: dict[str, str] = {}
    kept: set[str] = set()  # the machine's own: its requirements are met there already
    todo = [root]
    while todo:
        name = todo.pop()
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            raise SystemExit(f"gpu_wheels: {name} is required but not installed here (make setup)") from None
        for spec in dist.requires or []:
            req = Requirement(spec)
            key = canonicalize_name(req.name)
            if key in LEFT_OUT or (req.marker and not req.marker.evaluate(env)):
                continue
            specs.setdefault(key, []).append(req.specifier)
            if key in out or key in kept:
                continue
            if key in have:
                kept.add(key)
                continue
            out[key] = pinned.get(key) or distribution(req.name).version
            todo.append(req.name)
    for key in kept:  # a version there that some requirement refuses: bring ours
        if have[key] is not None and not all(s.contains(have[key], prereleases=True) for s in specs[key]):
            out[key] = pinned.get(key) or distribution(key).version
    return dict(sorted(out.items()))


def read_have(path: Path) -> dict[str, str | None]:
    """`pip list --format=freeze` lines (or bare names) as {canonical name: version or None}."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if name:
            out[canonicalize_name(name)] = version.strip() or None
    return out


def download(pins: dict[str, str], out: Path, python_version: str, also: list[str] = ()) -> None:
    """The project's wheel, then every pin's (and each of `also`) for the target Python and platforms."""
    out.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(ROOT)], check=True)
    cmd = [*pip, "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", str(out)]
    cmd += ["--python-version", python_version, "--implementation", "cp"]
    cmd += [x for p in PLATFORMS for x in ("--platform", p)]
    subprocess.run([*cmd, *(f"{k}=={v}" for k, v in pins.items())], check=True)
    for spec in also:  # one at a time: pip downloads a single version of each name per call
        subprocess.run([*cmd, spec], check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "wheels")
    p.add_argument("--python-version", default="3.11", help="the GPU machine's Python (major.minor)")
    p.add_argument("--have", type=Path, help="the GPU machine's `pip list --format=freeze`: left out")
    p.add_argument("--also", nargs="*", default=[], help="NAME==VERSION to offer beside the pins")
    p.add_argument("--list", action="store_true", help="print the pins and stop")
    args = p.parse_args()
    if args.have and not args.have.is_file():
        raise SystemExit(f"gpu_wheels: --have {args.have}: no such file")
    have = read_have(args.have) if args.have else None
    pins = closure(python_version=args.python_version, have=have)
    if args.list:
        print("\n".join(f"{k}=={v}" for k, v in pins.items()))
        return
    download(pins, args.out, args.python_version, args.also)
    size = sum(f.stat().st_size for f in args.out.glob("*.whl"))
    print(f"{args.out}: {len(pins)} dependencies and rlhf-batch, {size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
