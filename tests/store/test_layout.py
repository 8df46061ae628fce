"""store/layout.py: the temporary-name rule, and docs/on-disk.md against finished runs: every file
a run holds (the demo's assets, LoRA from an initial adapter, eval, a top-up round, a removed
policy, the report; an iteration with no trainable row) is named on that page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlhf_batch.store import layout

DOC = Path(__file__).resolve().parents[2] / "docs" / "on-disk.md"
# the placeholders of on-disk.md's trees, as regular expressions
PLACEHOLDERS = {
    "0000": r"\d{4}",
    "01": r"\d{2}",
    "RRRRR": r"\d{5}",
    "NNNNN": r"\d{5}",
    "N": r"\d+",
    "PID": r"\d+",
    "NAME": r"[^/]+",
    "...": r".+",
    "**/": r"(.*/)?",
    "*": r"[^/]*",
}
TOKEN = re.compile("|".join(re.escape(p) for p in sorted(PLACEHOLDERS, key=len, reverse=True)))


def _pattern(path: str) -> str:
    """A path of the page's trees as a regular expression (placeholders in capitals or digits)."""
    out, at = "", 0
    for m in TOKEN.finditer(path):
        out += re.escape(path[at : m.start()]) + PLACEHOLDERS[m.group()]
        at = m.end()
    return out + re.escape(path[at:])


def _tree(block: str) -> list[str]:
    """The paths of a tree, below the folders (ending in /) they are indented under. A line names
    one or more paths, then (after 3 spaces or more) what they are."""
    paths: list[str] = []
    stack: list[tuple[int, list[str]]] = []  # (indent, the folders of a line)
    for line in block.splitlines():
        if not line.strip():
            continue
        indent, words = len(line) - len(line.lstrip()), re.split(r" {3,}", line.strip())[0].split()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        above = [""]
        for _, folders in stack:
            above = [a + f for a in above for f in folders]
        paths += [a + w for a in above for w in words]
        if any(w.endswith("/") for w in words):
            stack.append((indent, [w for w in words if w.endswith("/")]))
    return paths


def documented() -> list[re.Pattern[str]]:
    """Every file on-disk.md names: the run tree (its first block, below RUN_DIR/), with
    MODEL_DIR/ standing for the files of a model dir (its second block)."""
    blocks = re.findall(r"```\n(.*?)```", DOC.read_text(), re.S)
    run, model = _tree(blocks[0]), _tree(blocks[1])
    paths = []
    for p in run:
        p = p.removeprefix("RUN_DIR/")
        if p.endswith("MODEL_DIR/"):
            paths += [p.removesuffix("MODEL_DIR/") + m for m in model]
        elif not p.endswith("/"):
            paths.append(p)
    return [re.compile(_pattern(p)) for p in paths]


def undocumented(run_dir: Path) -> list[str]:
    names = documented()
    files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    return [f for f in files if not any(n.fullmatch(f) for n in names)]


def test_the_check_finds_an_undocumented_file(tmp_path: Path) -> None:
    (tmp_path / "iter=0003" / "train").mkdir(parents=True)
    (tmp_path / "iter=0003" / "train" / "metrics.parquet").write_bytes(b"")
    (tmp_path / "iter=0003" / "policy").mkdir()
    (tmp_path / "iter=0003" / "policy" / "carried_from.json").write_text("{}")
    assert undocumented(tmp_path) == []
    (tmp_path / "iter=0003" / "policy" / "notes.json").write_text("{}")
    (tmp_path / "iter=0003" / "train" / "metrics.csv").write_text("")
    assert undocumented(tmp_path) == ["iter=0003/policy/notes.json", "iter=0003/train/metrics.csv"]


def test_one_temporary_name_rule_for_files_and_folders_and_the_older_folder_names(tmp_path: Path) -> None:
    final = tmp_path / "policy"
    tmp = layout.tmp_name(final, 4242)
    assert tmp.name == ".policy.4242.tmp" and layout.is_tmp(tmp.name)
    assert layout.is_tmp(layout.tmp_name(tmp_path / "part-00000-00001.parquet", 7).name)
    assert layout.is_tmp(".policy.tmp-4242")  # a folder an older version was killed writing
    for name in ("policy", ".rollouts.new", ".policy.removed-17", ".run.lock", "part-00000-00000.parquet"):
        assert not layout.is_tmp(name), name
    for name in (
        ".policy.4242.tmp",
        ".policy.tmp-99",
        ".optimizer.1.tmp",
        ".policy.removed-1",
        ".rollouts.new",
    ):
        (tmp_path / name).mkdir()
    assert [p.name for p in layout.leftovers(tmp_path, "policy")] == [".policy.4242.tmp", ".policy.tmp-99"]
    assert len(layout.leftovers(tmp_path)) == 3


def test_a_folder_an_older_version_was_killed_writing_is_removed_by_the_next_writer(tmp_path: Path) -> None:
    from rlhf_batch.store.atomic import write_dir_atomic

    old = tmp_path / ".optimizer.tmp-4242"  # the name older versions wrote folders under
    old.mkdir()
    (old / "optimizer.json").write_text("{}")
    write_dir_atomic(tmp_path / "optimizer", lambda tmp: (tmp / "optimizer.json").write_text("[]"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer"]


def _init_adapter(policy: str, out: Path) -> None:
    """A peft LoRA adapter (r 4, alpha 8, every linear layer) of the model `policy`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    get_peft_model(model, lora).save_pretrained(str(out))


@pytest.mark.slow
def test_every_file_of_finished_runs_is_named_in_on_disk_md(
    make_config, tmp_path: Path, demo_prompts: Path
) -> None:
    from rlhf_batch.commands.pipeline import run_pipeline
    from rlhf_batch.data.demo import ensure_demo_assets
    from rlhf_batch.stages.registry import run_stage

    # the demo's assets in the run dir; LoRA from an initial adapter; eval; a top-up round
    # (8 informative groups wanted of 4 prompts); keep_policies = 1 removes iteration 0's policy;
    # the reward cache, and an audit of iteration 0 after the run
    extra = f"""
        demo = true
        policy_model = "{{run_dir}}/models/policy"
        keep_policies = 1
        [score]
        reward_functions = ["rlhf_batch.rewards.demo:letter_count"]
        audit_functions = ["tests.stages.test_score:length_reward"]
        reward_cache = true
        [generate]
        prompts = "{{run_dir}}/data/prompts.jsonl"
        prompts_per_iteration = 4
        [advantage]
        min_groups = 8
        max_topup_rounds = 1
        [lora]
        enabled = true
        r = 4
        alpha = 8
        init_adapter = "{tmp_path / "adapter"}"
        [eval]
        prompts = "{demo_prompts}"
        n = 1
        prompts_per_part = 128
    """
    path, cfg = make_config(extra.replace("\n        ", "\n"), iterations=2, in_process=True, threads=1)
    ensure_demo_assets(cfg)
    _init_adapter(cfg.policy_model, tmp_path / "adapter")
    run_pipeline(path, [], quiet=True)
    run_stage("audit", cfg, 0, quiet=True)
    run_dir = Path(cfg.run_dir)
    assert list(run_dir.glob(f"{layout.REWARD_CACHE}/*/*/part-*.parquet"))
    assert (layout.folder(run_dir, 0, layout.AUDIT) / layout.MANIFEST).is_file()
    for name in (layout.INIT_ADAPTER, layout.POLICY_REMOVED, "report.html"):  # the run wrote them
        assert list(run_dir.rglob(name)), name
    assert list(run_dir.glob("iter=*/topup=01/rollouts")) and list(run_dir.glob("iter=*/eval"))
    assert undocumented(run_dir) == []

    # LoRA, no trainable row (groups of 4 < min_group_size): the base policy carried forward
    path, cfg = make_config(
        "[lora]\nenabled = true\n[advantage]\nmin_group_size = 100\n",
        name="empty.toml",
        run_dir=str(tmp_path / "empty"),
        iterations=1,
        in_process=True,
        threads=1,
    )
    run_pipeline(path, [], quiet=True)
    policy = layout.policy_dir(cfg.run_dir, 0)
    assert (policy / layout.CARRIED_FROM).is_file() and (policy / layout.LORA_BASE_COPY).is_file()
    assert undocumented(Path(cfg.run_dir)) == []
