"""Multi-turn generation of one part (generate.environment; docs/multi-turn.md).

Turn by turn over the part's trajectories: one batched sampling call (the engine's `sample`)
for the live ones, then their environments' steps in the worker pool (envs/pool.py). Turn t of a
trajectory samples from its own generator seeded by the rollout's seed (t = 0) or
row_seed(seed, "turn-t"), so its tokens depend only on its seed and its history. A trajectory ends
when its environment ends it (done, no observation), fails (`env_error`), after
`generate.max_turns` assistant turns, or at `generate.max_trajectory_tokens` response tokens (its
last turn cut, or the observation that would not fit left out: finish_reason 'length', counted
as `dropped_observations` in the manifest). An environment's observation may be several
messages (a list: one tool result per call), each a segment of its own.

After each turn the state of every trajectory of the part is committed to
`turns/part-NNNNN.json` in the stage's folder; a run killed mid-part resumes at its last complete
turn (the environments are made again and replayed from the committed texts) and writes the same
rows as an uninterrupted run. A checkpoint carries the stage's identity (the key `_started.json`
records): one a run with another config or inputs left is discarded and the part starts over.
The file is removed once the part is written, the folder once the stage is committed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from rlhf_batch.config import Config
from rlhf_batch.envs.glue import observation_ids
from rlhf_batch.envs.pool import Call, EnvPool
from rlhf_batch.errors import StageError
from rlhf_batch.runtime.faults import fault_point
from rlhf_batch.store import fs
from rlhf_batch.store.atomic import write_json_atomic
from rlhf_batch.store.ids import row_seed
from rlhf_batch.store.layout import STARTED, TURNS_DIR
from rlhf_batch.store.schemas import TURN_REWARDS, TURNS


@dataclass
class Trajectory:
    ids: list[int] = field(default_factory=list)  # every response token
    logps: list[float] = field(default_factory=list)  # 0.0 on the environment's tokens
    mask: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # the assistant turns' texts (for the environment)
    finish: str = "stop"
    done: bool = False
    error: str | None = None
    seconds: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)  # Step.reward of each assistant turn answered
    dropped: int = 0  # 1: the environment's last answer was left out for length

    def add(self, ids: list[int], logps: list[float], role: str) -> None:
        self.starts.append(len(self.ids))
        self.roles.append(role)
        self.ids += ids
        self.logps += logps
        self.mask += [int(role == "assistant")] * len(ids)


class _Quiet:
    """The engine's progress bar during a turn: the stage's bar counts finished trajectories."""

    def update(self, n: int) -> None: ...

    def set_postfix(self, **_: Any) -> None: ...


def turn_seed(seed: int, turn: int) -> int:
    return seed if turn == 0 else row_seed(seed, f"turn-{turn}")


def checkpoint_path(sdir: Path, n: int) -> Path:
    return sdir / TURNS_DIR / f"part-{n:05d}.json"


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text() if fs.store_of(path).local else fs.get_bytes(path))
    except (FileNotFoundError, OSError, ValueError):
        return None


def stage_key(sdir: Path) -> str | None:
    """The identity key of the stage run writing `sdir` (recorded in `_started.json` when it
    claimed the folder)."""
    started = _read(sdir / STARTED)
    return started.get("key") if isinstance(started, dict) else None


def _load(path: Path, rids: list[str], key: str | None) -> tuple[int, list[Trajectory]] | None:
    state = _read(path)
    if not isinstance(state, dict) or state.get("rollout_ids") != rids:  # another part's plan
        return None
    if key is None or state.get("key") != key:  # another config or inputs: start the part over
        return None
    return int(state["turn"]), [Trajectory(**t) for t in state["trajectories"]]


def _save(path: Path, rids: list[str], key: str | None, turn: int, trajs: list[Trajectory]) -> None:
    fs.makedirs(path.parent)
    state = {"key": key, "rollout_ids": rids, "turn": turn, "trajectories": [asdict(t) for t in trajs]}
    write_json_atomic(path, state)


def environment_factory(cfg: Config, ref: str) -> Any:
    """The environment factory `ref` names (a bad name: one line), its module looked up where
    reward modules are (`reward_search_path`: beside the config, which `run`'s `python -P` stage
    processes do not otherwise see; spawned environment workers inherit sys.path)."""
    from rlhf_batch.config import reward_search_path
    from rlhf_batch.envs.pool import load_factory
    from rlhf_batch.rewards import add_search_path

    add_search_path(reward_search_path(cfg))
    return load_factory(ref, cfg.generate.tool_sandbox)


def open_pool(cfg: Config, g: Any) -> EnvPool:
    """The environments' worker processes for the sampling settings `g` (generate's or eval's)."""
    environment_factory(cfg, g.environment)
    return EnvPool(g.environment, g.env_workers, g.env_timeout_s, cfg.generate.tool_sandbox, g.tool_parser)


def write_turn_parts(stage: Any, todo: list[int], out: Any, bar: Any) -> None:
    """The parts of a stage that samples trajectories (generate, eval), one by one; a part's turn
    checkpoint is removed once the part is written."""
    for n in todo:
        out.write(n, stage.write_part(n, bar))
        fs.remove(checkpoint_path(stage.sdir, n))


def drop_checkpoints(sdir: Path) -> None:
    """The turn checkpoints a kill left, once the stage is committed (not before: fanned out, the
    other ranks may still be writing theirs)."""
    from rlhf_batch.store.manifests import manifest

    if manifest(sdir) is not None:
        fs.remove(sdir / TURNS_DIR)


def sample_part(
    engine: Any,
    pool: EnvPool,
    tok: Any,
    cfg: Config,
    plan: Any,
    rows: list[dict[str, Any]],
    where: Path,
    n: int,
) -> list[Trajectory]:
    """Every trajectory of part n (`plan`: generate.PartRows; `rows`: each one's prompt row)."""
    g = cfg.generate
    path, key = checkpoint_path(where, n), stage_key(where)
    first, trajs = _load(path, plan.rids, key) or (0, [Trajectory() for _ in plan.rids])
    positions = context_limit(engine)

    def fits(i: int, extra: int) -> bool:
        """Whether trajectory i can take `extra` more tokens and still sample a whole turn."""
        total = len(trajs[i].ids) + extra
        if g.max_trajectory_tokens and total >= g.max_trajectory_tokens:
            return False
        return not positions or len(plan.prompts[i]) + total + g.max_new_tokens <= positions

    for turn in range(first, g.max_turns):
        live = [i for i, t in enumerate(trajs) if not t.done]
        if not live:
            break
        contexts = [plan.prompts[i] + trajs[i].ids for i in live]
        results = engine.sample(contexts, [turn_seed(plan.seeds[i], turn) for i in live], _Quiet())
        stepped = [i for i, res in zip(live, results, strict=True) if _assistant_turn(trajs[i], res, tok, g)]
        _env_turn(pool, tok, trajs, stepped, rows, plan.rids, turn + 1 == g.max_turns, fits)
        fault_point(f"rollouts:part-{n}:turn-{turn}")
        _save(path, plan.rids, key, turn + 1, trajs)
    try:
        check_errors(trajs, plan.rids, g.max_env_error_share, n)
    except StageError:
        fs.remove(path)  # a rerun with the environment fixed samples the part again
        raise
    return trajs


def context_limit(engine: Any) -> int | None:
    """The tokens a trajectory's context may hold with its next turn: the vLLM engine's
    `max_model_len`, else the model's positions (None: no limit known)."""
    if (limit := getattr(engine, "max_context", None)) is not None:
        return int(limit)
    config = getattr(getattr(engine, "model", None), "config", None)
    return getattr(config, "max_position_embeddings", None)


def _assistant_turn(t: Trajectory, res: tuple[list[int], list[float], str], tok: Any, g: Any) -> bool:
    """Append a sampled turn; False when the token budget cut it (the trajectory ends there)."""
    ids, logps, reason = res
    room = g.max_trajectory_tokens - len(t.ids) if g.max_trajectory_tokens else len(ids)
    cut = len(ids) > room
    if cut:
        ids, logps, reason = ids[:room], logps[:room], "length"
    t.add(ids, logps, "assistant")
    t.texts.append(tok.decode(ids[:-1] if reason == "stop" else ids, skip_special_tokens=False))
    t.finish, t.done = reason, cut
    return not cut


def _env_turn(
    pool: EnvPool,
    tok: Any,
    trajs: list[Trajectory],
    idx: list[int],
    rows: list[dict[str, Any]],
    rids: list[str],
    last: bool,
    fits: Any,
) -> None:
    """The environments answer the turn just sampled (trajectories `idx`)."""
    calls = [Call(rids[i], rows[i], tuple(trajs[i].texts)) for i in idx]
    for i, out in zip(idx, pool.step(calls, idx), strict=True):
        t = trajs[i]
        t.seconds += out.seconds
        for k, v in out.reward_parts.items():
            t.parts[k] = t.parts.get(k, 0.0) + v
        if out.step is not None:
            t.rewards.append(out.step.reward)
        if out.error is not None:
            t.error, t.done = out.error, True
            continue
        step = out.step
        if step is None or step.ends or last:
            t.done = True
            continue
        stopped = t.finish == "stop"
        obs = observation_ids(tok, step.role, step.observation or "", t.ids[-1] if t.ids else None, stopped)
        if not fits(i, sum(map(len, obs))):
            t.done, t.finish, t.dropped = True, "length", 1  # no room for the observation and another turn
            continue
        for ids in obs:  # one segment per message
            t.add(ids, [0.0] * len(ids), step.role)


def check_errors(trajs: list[Trajectory], rids: list[str], share: float, n: int) -> None:
    """StageError (one line naming the first error) when more than `share` of part n's
    trajectories ended in env_error (generate.max_env_error_share): a broken environment stops
    the stage instead of filling the run with trajectories cut at their first turn."""
    failed = [(rid, t.error) for rid, t in zip(rids, trajs, strict=True) if t.error is not None]
    if trajs and len(failed) > share * len(trajs):
        rid, error = failed[0]
        raise StageError(
            f"generate.environment failed in {len(failed)} of {len(trajs)} trajectories of part {n} "
            f"(more than generate.max_env_error_share = {share:g}); first, rollout {rid}: {error}"
        )


def turn_columns(trajs: list[Trajectory]) -> dict[str, pa.Array]:
    """The TURNS columns and the environment's reward parts (env_<name>, 0.0 where a trajectory
    got none) of a part."""
    turns = [t.roles.count("assistant") for t in trajs]
    cols = {
        "loss_mask": [t.mask for t in trajs],
        "turn_starts": [t.starts for t in trajs],
        "turn_roles": [t.roles for t in trajs],
        "turns": turns,
        "env_error": [t.error for t in trajs],
        "env_seconds": [t.seconds for t in trajs],
        # one per assistant turn: what the environment's answer to it said the turn earned (0.0
        # for a turn it did not answer: an error, or the token budget ended the trajectory)
        "turn_rewards": [(t.rewards + [0.0] * n)[:n] for t, n in zip(trajs, turns, strict=True)],
    }
    types = pa.unify_schemas([TURNS, TURN_REWARDS])
    out = {k: pa.array(v, types.field(k).type) for k, v in cols.items()}
    for name in sorted({k for t in trajs for k in t.parts}):
        out[f"env_{name}"] = pa.array([t.parts.get(name, 0.0) for t in trajs], pa.float64())
    return out
