import dataclasses
from pathlib import Path

import pytest

from rlhf_batch.config import Config, load_config
from rlhf_batch.errors import ConfigError, UserError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_defaults_tables_and_overrides(tmp_path: Path) -> None:
    p = write(tmp_path, 'run_dir = "runs/x"\nseed = 2\n[generate]\ntemperature = 0.9\n[train]\nlr = 1\n')
    cfg = load_config(
        p, ["generate.temperature=0.7", "seed=3", "run_dir=/tmp/run1", "train.aggregation=token_mean"]
    )
    assert cfg.generate.temperature == 0.7
    assert cfg.seed == 3
    assert cfg.run_dir == "/tmp/run1"
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)  # an int where a float is expected is fine
    assert cfg.generate.num_generations == Config().generate.num_generations


def test_relative_paths_and_run_dir_placeholder(tmp_path: Path) -> None:
    p = write(tmp_path, 'run_dir = "runs/a"\npolicy_model = "{run_dir}/models/policy"\n')
    cfg = load_config(p)
    assert cfg.run_dir == str(tmp_path / "runs/a")
    assert cfg.policy_model == str(tmp_path / "runs/a/models/policy")
    assert cfg.ref == cfg.policy_model  # the reference defaults to the initial policy
    cfg = load_config(p, ["run_dir=elsewhere"])
    assert cfg.run_dir == str(Path.cwd() / "elsewhere")  # command-line paths: relative to the cwd
    assert cfg.policy_model == str(Path.cwd() / "elsewhere/models/policy")


@pytest.mark.parametrize(
    ("text", "overrides", "needle"),
    [
        ("[generate]\ntemprature = 0.7\n", [], "unknown key 'generate.temprature'"),
        ("sed = 1\n", [], "unknown key 'sed'"),
        ("[generate]\nnum_generations = 'four'\n", [], "'generate.num_generations' must be int"),
        ("[train]\nrecompute_old = 1\n", [], "'train.recompute_old' must be bool"),
        ("seed = true\n", [], "'seed' must be int"),
        ("[advantage]\nestimator = 'ppo'\n", [], "'advantage.estimator' must be one of"),
        # drgrpo and rloo divide by no std: a scale other than the default would be ignored
        ("[advantage]\nestimator = 'drgrpo'\nscale = 'batch'\n", [], "'advantage.scale' is used only with"),
        ("", ["advantage.estimator=rloo", "advantage.scale=none"], "'advantage.scale' is used only with"),
        ("", ["generate.temperature=0"], "'generate.temperature' must be > 0"),
        ("", ["nosuch.key=1"], "unknown key 'nosuch'"),
        ("", ["generate"], "expected KEY=VALUE"),
        ("generate = 3\n", [], "'generate' must be a table"),
        (
            "[score]\nreward_functions = ['a:b']\nreward_weights = [1.0, 2.0]\n",
            [],
            "'score.reward_weights' has 2",
        ),
        ("[train]\ndual_clip = 0.5\n", [], "'train.dual_clip' must be 0 (off) or > 1"),
        ("", ["train.sequences_per_step=-1"], "'train.sequences_per_step' must be >= 0"),
        ("fsync = 'no'\n", [], "'fsync' must be bool"),
        ("[generate\n", [], "not valid TOML"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, text: str, overrides: list[str], needle: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p, overrides)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_identity_holds_the_keys_each_field_declares() -> None:
    cfg = Config()
    score = cfg.identity("score")
    assert "max_tokens_per_batch" not in score["score"]  # a resume may lower the budget
    assert score["generate"] == {"temperature": 1.0} and score["reward_model"] == ""
    # advantage.replay decides nothing as a key: its settings and sources are advantage's inputs
    # when it is on (stages/replay.py), so identities without it stay as they were; likewise the
    # rows of SFT and DPO iterations (data/selection.py), recorded on those iterations only, and
    # turn_credit (the advantage stage records it when "to_go")
    unrecorded = ("replay", "select", "pairs", "pair_margin", "turn_credit", "turn_discount")
    table = {k: v for k, v in dataclasses.asdict(cfg.advantage).items() if k not in unrecorded}
    assert cfg.identity("advantage") == {"seed": 0, "advantage": table}
    generate = cfg.identity("generate")
    assert "reward_model" not in generate and "ref_model" not in generate and "score" not in generate
    assert "ref_model" not in cfg.identity("train") and cfg.identity("train")["train"]["kl_loss_coef"] == 0.0
    for stage in ("generate", "import", "score", "advantage", "train"):
        assert not {"iterations", "in_process", "demo"} & cfg.identity(stage).keys()
        # the thread count changes float rounding: it decides the stages that run a model
        assert ("threads" in cfg.identity(stage)) == (stage != "advantage")


@pytest.mark.parametrize(
    ("text", "overrides", "needle"),
    [
        ("[score]\nkl_coef = 0.1\n", [], "'score.kl_coef' was renamed to 'score.kl_reward_coef'"),
        ("", ["train.kl_coef=0.1"], "'train.kl_coef' was renamed to 'train.kl_loss_coef'"),
        (
            "[advantage]\nrows_per_shard = 8\n",
            [],
            "'advantage.rows_per_shard' was renamed to 'advantage.rows_per_part'",
        ),
    ],
)
def test_renamed_keys_are_refused_naming_the_new_name(
    tmp_path: Path, text: str, overrides: list[str], needle: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), overrides)
    assert needle in str(e.value)


def test_each_table_validates_itself() -> None:
    from rlhf_batch.config import ScoreConfig, TrainConfig

    with pytest.raises(ConfigError, match="'score.kl_reward_coef' must be >= 0"):
        ScoreConfig(kl_reward_coef=-1.0).validate()
    with pytest.raises(ConfigError, match="'train.dual_clip' must be 0 \\(off\\) or > 1"):
        TrainConfig(dual_clip=0.5).validate()


def test_engine_keys_decide_generate_but_where_it_runs_does_not(tmp_path: Path) -> None:
    from rlhf_batch.config import GenerateConfig, TrainConfig

    generate = Config().identity("generate")["generate"]
    assert generate["engine"] == "hf" and generate["tensor_parallel_size"] == 1
    assert "python" not in generate and "gpu_memory_utilization" not in generate
    assert Config().identity("train")["train"]["tis_cap"] == 0.0
    cfg = load_config(write(tmp_path, "[generate]\npython = 'venv/bin/python'\n"))
    assert cfg.generate.python == str(tmp_path / "venv/bin/python")  # relative to the config file
    with pytest.raises(ConfigError, match="'generate.engine' = 'vllm' needs top_k = 0 and top_p = 1"):
        GenerateConfig(engine="vllm", top_k=5).validate()
    with pytest.raises(ConfigError, match="'generate.gpu_memory_utilization' must be in \\(0, 1\\]"):
        GenerateConfig(gpu_memory_utilization=1.5).validate()
    with pytest.raises(ConfigError, match="'train.tis_cap' must be 0 \\(off\\) or >= 1"):
        TrainConfig(tis_cap=0.5).validate()


def test_each_side_has_its_device_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlhf_batch.commands.lanes import use_side

    cfg = load_config(None, ["threads=2", "device=cpu", "generate.device=cuda:0,1", "train.threads=1"])
    # generate/score/import: generate's device (its CUDA devices listed), the run's threads
    assert [cfg.side(s) for s in ("generate", "score", "import")] == [("cuda", 2, "0,1")] * 3
    # advantage/train/eval: train's threads, the run's device
    assert [cfg.side(s) for s in ("advantage", "train", "eval")] == [("cpu", 1, None)] * 3
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    use_side(cfg, "score")
    assert (cfg.device, cfg.threads) == ("cuda", 2)
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("generate.device=gpu", "'generate.device' must be"),
        ("train.device=cuda:a", "'train.device' must be"),
        ("train.threads=-1", "'train.threads' must be >= 0"),
        ("max_staleness=-1", "'max_staleness' must be >= 0"),
    ],
)
def test_side_and_staleness_keys_are_checked(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])


def test_keep_policies_must_outlast_the_staleness() -> None:
    # S = 2: iteration K samples from iteration K-3's policy, so the last 2 trained are too few
    with pytest.raises(ConfigError, match="'keep_policies' must be 0 or > max_staleness"):
        load_config(None, ["max_staleness=2", "keep_policies=2"])
    assert load_config(None, ["max_staleness=2", "keep_policies=3"]).keep_policies == 3


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["train.ratio_level=sequence"], "'train.ratio_level' 'sequence' (GSPO) needs train.aggregation"),
        (["train.ratio_level=segment"], "'train.ratio_level' must be one of"),
        (["train.loss=cispo", "train.ratio_level=sequence", "train.aggregation=seq_mean_token_mean"],
         "'train.loss' 'cispo' weighs token ratios"),
        (["train.loss=cispo", "train.dual_clip=3"], "'train.dual_clip' applies to the token-level PPO"),
        (["train.loss=cispo", "train.cispo_max=0"], "'train.cispo_max' must be > 0"),
        (["train.seq_eps_low=0"], "'train.seq_eps_low' must be > 0"),
        (["train.tis_mode=mask", "train.tis_cap=0"], "'train.tis_cap' is the upper bound of tis_mode 'mask'"),
        (["train.tis_low=0.5"], "'train.tis_low' bounds the band"),
        (["train.tis_mode=mask", "train.tis_low=1"], "'train.tis_low' must be in [0, 1)"),
        (["train.tis_mode=drop"], "'train.tis_mode' must be one of"),
    ],
)  # fmt: skip
def test_objective_combinations_are_one_line_errors(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_objective_defaults_and_mask_cap() -> None:
    cfg = load_config(None, [])
    tc = cfg.train
    assert (tc.ratio_level, tc.loss, tc.tis_mode, tc.tis_cap) == ("token", "ppo", "truncate", 0.0)
    # a mask mode with tis_cap unset takes TRL's C_max default, 3
    assert load_config(None, ["train.tis_mode=mask"]).train.tis_cap == 3.0
    assert load_config(None, ["train.tis_mode=mask", "train.tis_cap=2"]).train.tis_cap == 2.0


def test_objective_keys_at_their_defaults_leave_the_train_identity_as_before() -> None:
    from rlhf_batch.stages.train.stage import OBJECTIVE_DEFAULTS

    cfg = Config()
    assert {k: getattr(cfg.train, k) for k in OBJECTIVE_DEFAULTS} == OBJECTIVE_DEFAULTS


def test_the_teacher_model_path_is_relative_to_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "models").mkdir()  # a path whose first part exists is local, never a hub id
    p = write(tmp_path, '[score]\nteacher_model = "models/teacher"\n')
    assert load_config(p).score.teacher_model == str(tmp_path / "models/teacher")
    # an org/name that is no local path: a hub id (not in the cache here: one line naming the key)
    with pytest.raises(UserError, match="^score.teacher_model: 'org/teacher' is not a local directory"):
        load_config(p, ["score.teacher_model=org/teacher"])


@pytest.mark.parametrize(
    ("text", "message"),
    [  # each TRL / verl name answered with ours, as written in docs/configuration.md
        (
            "[train]\nimportance_sampling_level = 'sequence'\n",
            "unknown key 'train.importance_sampling_level': TRL's importance_sampling_level = 'sequence' is "
            "train.ratio_level = 'sequence' (GSPO) here",
        ),
        (
            "[train]\nloss_type = 'grpo'\n",
            "unknown key 'train.loss_type': TRL's loss_type = 'grpo' is train.aggregation = 'seq_mean_token_mean' here",
        ),
        (
            "[train]\nloss_type = 'dapo'\n",
            "unknown key 'train.loss_type': TRL's loss_type = 'dapo' is train.aggregation = 'token_mean' here",
        ),
        ("[train]\nloss_type = 'cispo'\n", "TRL's loss_type = 'cispo' is train.loss = 'cispo' here"),
        (  # a value with no counterpart: the key's, with the values that have one
            "[train]\nloss_type = 'sapo'\n",
            "unknown key 'train.loss_type': TRL's loss_type is train.loss ('ppo' or 'cispo') and train.aggregation "
            "here (its values 'grpo', 'bnpo', 'dapo', 'dr_grpo', 'cispo' have ours)",
        ),
        (
            "[train]\nvllm_importance_sampling_mode = 'token_mask'\n",
            "TRL's vllm_importance_sampling_mode = 'token_mask' is train.tis_mode = 'mask' here",
        ),
        (
            "[train]\nbeta = 0.04\n",
            "unknown key 'train.beta': TRL's beta is train.kl_loss_coef (DPOConfig's beta: train.dpo_beta) here",
        ),
        (  # any table
            "beta = 0.04\n",
            "unknown key 'beta': TRL's beta is train.kl_loss_coef (DPOConfig's beta: train.dpo_beta) here",
        ),
        ("[train]\nclip_ratio_low = 0.2\n", "verl's clip_ratio_low is train.eps_low here"),
        ("[train]\nclip_ratio_high = 0.28\n", "verl's clip_ratio_high is train.eps_high here"),
        (
            "[train]\nloss_mode = 'gspo'\n",
            "verl's loss_mode = 'gspo' is train.ratio_level = 'sequence' (GSPO) here",
        ),
        (
            "[train]\nloss_agg_mode = 'seq-mean-token-mean'\n",
            "verl's loss_agg_mode = 'seq-mean-token-mean' is train.aggregation = 'seq_mean_token_mean' here",
        ),
        ("[train]\nepsilon = 0.2\n", "TRL's epsilon is train.eps_low here"),
    ],
)
def test_trl_and_verl_names_are_answered_with_ours(tmp_path: Path, text: str, message: str) -> None:
    """Never a "did you mean" guessed from the spelling (loss_mode was answered with
    train.tis_mode, loss_type with train.loss whatever its value)."""
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert str(e.value).endswith(message) and "did you mean" not in str(e.value)
    assert "\n" not in str(e.value)


def test_every_trl_and_verl_name_is_in_the_docs_table() -> None:
    from rlhf_batch.config import FOREIGN

    doc = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    table = doc[doc.index("## Names from TRL and verl") :]
    for key, (source, _, _) in FOREIGN.items():
        assert f"| {source} | `{key}`" in table, key


@pytest.mark.parametrize(
    "subquery",
    [
        "(SELECT count(*) FROM read_text('/etc/hostname')) > 0",
        "EXISTS (SELECT * FROM '/etc/hostname')",
    ],
)
def test_a_predicate_that_reads_a_file_is_refused_by_every_key(subquery: str) -> None:
    """generate.prompt_filter, advantage.replay.where and advantage.select.where pass through one
    guard: none may read a file, whichever connection would run it."""
    with pytest.raises(ConfigError, match=r"generate.prompt_filter.*reads") as e:
        load_config(None, [f'generate.prompt_filter="{subquery}"'])
    assert "\n" not in str(e.value)
    replay = f'advantage.replay={{iterations = 1, max_share = 0.5, where = "{subquery}"}}'
    with pytest.raises(ConfigError, match=r"advantage.replay.*where reads") as e:
        load_config(None, ["train.recompute_old=true", replay])
    assert "\n" not in str(e.value)
    select = f'advantage.select={{where = "{subquery}"}}'
    with pytest.raises(ConfigError, match=r"advantage.select.*where reads") as e:
        load_config(None, ["train.objective='sft'", select])
    assert "\n" not in str(e.value)
    # a subquery over the scored rollouts themselves stays allowed
    ok = "advantage.replay={iterations = 1, max_share = 0.5, where = 'prompt_id IN (SELECT prompt_id FROM scored)'}"
    load_config(None, ["train.recompute_old=true", ok])
    ok = "advantage.select={where = 'prompt_id IN (SELECT prompt_id FROM scored)'}"
    load_config(None, ["train.objective='sft'", ok])
