"""Stage runs through the command line, reads of their output files with pyarrow, and log-probs
from a plain transformers forward pass: the tests built on these depend on the CLI and the
on-disk layout, not on the package's internals."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from typer.testing import CliRunner

from rlhf_batch.commands.cli import app


def cli(*args: object) -> object:
    """Invoke `rlhf-batch ARGS`; the click Result (exit_code, output, exception)."""
    return CliRunner().invoke(app, [str(a) for a in args])


def ok(*args: object) -> None:
    res = cli(*args)
    assert res.exit_code == 0, (res.output, res.exception)  # type: ignore[attr-defined]


def stage(config: Path, name: str, *sets: str, it: int = 0, force: bool = False) -> None:
    """Run one stage command to completion (exit 0)."""
    args = [name, config, "--iter", it, "--quiet", *[a for s in sets for a in ("--set", s)]]
    ok(*args, *(["--force"] if force else []))


def small_prompts(tmp_path: Path, n: int = 4) -> Path:
    """`n` demo prompts (`init-prompts`): with G = 4, 4n rollouts."""
    ok("init-prompts", tmp_path / "prompts.jsonl", "--n", n)
    return tmp_path / "prompts.jsonl"


def manifest(run_dir: str | Path, folder: str, it: int = 0) -> dict:
    return json.loads((Path(run_dir) / f"iter={it:04d}" / folder / "_manifest.json").read_text())


def part_files(run_dir: str | Path, folder: str, it: int = 0) -> list[Path]:
    """The part files a complete stage's manifest lists, in order."""
    sdir = Path(run_dir) / f"iter={it:04d}" / folder
    return [sdir / p["file"] for p in manifest(run_dir, folder, it)["parts"]]


def read(run_dir: str | Path, folder: str, it: int = 0) -> pa.Table:
    """Every row of a complete stage, parts in manifest order."""
    return pa.concat_tables([pq.read_table(p) for p in part_files(run_dir, folder, it)])


def rewrite(path: Path, table: pa.Table) -> None:
    """Replace a part file's rows, keeping its schema and metadata (as an outside edit would)."""
    schema = pq.read_schema(path)
    pq.write_table(table.cast(schema).replace_schema_metadata(schema.metadata), path)


def unpadded_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:  # noqa: ANN001
    """[len(response)] log-probs of the response tokens: one row, no padding, no cache, float32."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()  # [P + R, V]
    pred = logits[len(prompt) - 1 : -1] / temperature  # [R, V]: position j predicts response token j
    return torch.log_softmax(pred, -1).gather(1, torch.tensor(response)[:, None])[:, 0]  # [R]
