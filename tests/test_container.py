"""The Dockerfile, as far as this machine allows (a docker client, no daemon): hadolint passes it
(and fails a planted mistake), everything it copies exists and is not left out of the build
context by .dockerignore, what it installs is the project's (its extras, its pins), and
`make image` builds it with the variant asked for."""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HADOLINT = REPO / ".venv-deploy" / "bin" / "hadolint"  # make deploy


def hadolint(dockerfile: Path) -> subprocess.CompletedProcess:
    assert HADOLINT.exists(), "run `make deploy` (the suite's linters)"
    return subprocess.run(
        [str(HADOLINT), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )


def test_hadolint_passes_the_dockerfile_and_fails_a_planted_mistake(tmp_path: Path) -> None:
    res = hadolint(REPO / "Dockerfile")
    assert res.returncode == 0, res.stdout + res.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        (REPO / "Dockerfile").read_text().replace("FROM python:${PYTHON_VERSION}-slim", "FROM python:latest")
    )
    res = hadolint(bad)
    assert res.returncode == 1 and "DL3007" in res.stdout  # "Using latest is prone to errors"


def ignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    return any(
        fnmatch.fnmatch(rel, p)
        or any(fnmatch.fnmatch("/".join(parts[: i + 1]), p) for i in range(len(parts)))
        for p in patterns
    )


def test_everything_the_dockerfile_copies_is_in_the_build_context() -> None:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    patterns = [x.strip() for x in (REPO / ".dockerignore").read_text().splitlines() if x.strip()]
    copies = [shlex.split(line)[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
    sources = [s for c in copies for s in c if not s.startswith("--")]
    assert {"pyproject.toml", "constraints.txt", "rlhf_batch"} <= set(sources)
    for src in sources:
        assert (REPO / src).exists(), src
        assert not ignored(src, patterns), f"{src} is left out of the build context by .dockerignore"
    assert ignored(".venv-vllm/bin/python", patterns) and ignored("runs/demo/x", patterns)


def test_the_dockerfile_installs_the_projects_extras_and_pins() -> None:
    text = (REPO / "Dockerfile").read_text()
    extras = set(re.findall(r'"\.\[([a-z0-9,]+)\]"', text))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert extras and all(e in project["optional-dependencies"] for x in extras for e in x.split(","))
    assert "-c constraints.txt" in text and "torch==" in (REPO / "constraints.txt").read_text()
    assert "rlhf-batch --help" in text  # the image's entry point is checked as it is built


def test_make_image_builds_the_variant_asked_for() -> None:
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "image", "VARIANT=cuda", "IMAGE=reg.example.com/rlhf-batch:1"],
        cwd=REPO,
        # under `make test` the parent's MAKEFLAGS (-w) would add "Entering directory" lines
        env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "docker build --build-arg VARIANT=cuda -t reg.example.com/rlhf-batch:1 ."
    assert 'case "$VARIANT" in' in (REPO / "Dockerfile").read_text()
