"""The environment pool: a good step, and each way an environment fails, which ends only its
trajectory (an Outcome with `error`), never the caller."""

import os
import sys
import time

import pytest

from rlhf_batch.envs.base import Step
from rlhf_batch.envs.pool import Call, EnvPool, load_factory
from rlhf_batch.errors import UserError


class Echo:
    """Counts its steps: turn k answers "k:<text>" (a replayed environment counts the same)."""

    def __init__(self, row: dict) -> None:
        self.kind, self.n = row["kind"], 0

    def step(self, text: str) -> Step:
        self.n += 1
        if self.kind == "raise":
            raise RuntimeError("tool broke\nsecond line")
        if self.kind == "hang":
            time.sleep(60)
        if self.kind == "garbage":
            return 42  # type: ignore[return-value]
        if self.kind == "badobs":
            return Step(observation=b"bytes")  # type: ignore[arg-type]
        if self.kind == "die":
            os._exit(3)
        return Step(f"{self.n}:{text}", reward_parts={"steps": 1.0})


def factory(row: dict) -> Echo:
    return Echo(row)


REF = "tests.envs.test_pool:factory"


def test_good_steps_replay_and_every_failure_is_an_outcome() -> None:
    pool = EnvPool(REF, 2, timeout=2.0)
    try:
        kinds = ["ok", "raise", "hang", "garbage", "badobs", "die", "ok"]
        calls = [Call(f"r{i}", {"kind": k}, ("a",)) for i, k in enumerate(kinds)]
        out = pool.step(calls, list(range(len(calls))))
        assert out[0].step.observation == "1:a" and out[0].reward_parts == {"steps": 1.0}
        assert out[1].error == "raised RuntimeError: tool broke"  # one line
        assert out[2].error == "timed out after 2 s"
        assert out[3].error == "the environment returned int, not a Step"
        assert out[4].error == "observation is bytes, not str"
        assert out[5].error == "the environment's process died (exit code 3)"
        assert out[6].step.observation == "1:a"  # the replaced workers go on
        # turn 2 of r0 in its worker (held: step 2), and in the other worker (made again and
        # replayed: its first text stepped again, so it also answers as step 2)
        again = pool.step([Call("r0", {"kind": "ok"}, ("a", "b"))] * 2, [0, 1])
        assert [o.step.observation for o in again] == ["2:b", "2:b"]
    finally:
        pool.close()


def test_a_bad_factory_name_is_one_line() -> None:
    with pytest.raises(UserError, match=r"^generate.environment: cannot load 'tests.envs.nope:f' \(Module"):
        load_factory("tests.envs.nope:f")
    with pytest.raises(UserError, match="cannot load 'tests.envs.test_pool:nope' \\(AttributeError"):
        load_factory("tests.envs.test_pool:nope")


def test_a_factory_beside_the_config_is_found_in_the_spawned_workers(tmp_path, monkeypatch) -> None:
    # run's stage processes start python with -P: a module beside the config is on sys.path only
    # once the stage adds the search dirs (as for reward modules); the spawned workers inherit it
    from rlhf_batch.rewards import add_search_path

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "beside_config_env.py").write_text(
        "from rlhf_batch.envs.base import Step\n\n"
        "class E:\n    def step(self, text):\n        return Step('seen ' + text, done=True)\n\n"
        "def make(row):\n    return E()\n"
    )
    with pytest.raises(UserError, match="cannot load 'beside_config_env:make'"):
        EnvPool("beside_config_env:make", 1, timeout=30.0)
    add_search_path([str(tmp_path)])
    pool = EnvPool("beside_config_env:make", 1, timeout=30.0)
    try:
        out = pool.step([Call("r0", {}, ("hi",))], [0])
        assert out[0].error is None and out[0].step.observation == "seen hi"
    finally:
        pool.close()
