"""The multi-turn demo task (envs/demo.py, rewards/demo.py:ask_letter): the letter is only in the
environment's answer, so a policy that ignores that answer scores at chance."""

import itertools
import json

from rlhf_batch.data.demo import LETTERS, MAX_COUNT, write_prompts
from rlhf_batch.envs.demo import ask_letter
from rlhf_batch.rewards.demo import ask_letter as reward


def play(letter: str, count: int, turn1: str, turn2: str) -> tuple[float, str | None]:
    """The reward of one trajectory, and the letter the environment revealed after turn 1."""
    env = ask_letter({"letter": letter, "count": count})
    first, second = env.step(turn1), env.step(turn2)
    assert not first.ends and first.role == "user" and second.ends
    parts = {k: first.reward_parts[k] + second.reward_parts[k] for k in ("asked", "answer")}
    (r,) = reward(env_answer=[parts["answer"]], env_asked=[parts["asked"]])
    return r, first.observation


def test_the_prompt_hides_the_letter_and_the_environment_reveals_it(tmp_path) -> None:
    rows = [json.loads(line) for line in write_prompts(tmp_path / "p", 64, hidden=True).open()]
    assert {r["prompt"] for r in rows} <= {f"?*{k}=" for k in range(1, MAX_COUNT + 1)}
    for r in rows:
        assert r["prompt"] == f"?*{r['count']}=" and r["letter"] in LETTERS
        assert play(r["letter"], r["count"], "?", r["letter"] * r["count"]) == (1.0, r["letter"])


def test_asking_gets_partial_credit() -> None:
    # 0.2 x asked, asked = letter_count's score of turn 1 against "?" once: 1, 1/2, 1/4, 0
    for turn1, want in (("?", 0.2), ("?x", 0.1), ("?abc", 0.05), ("x?", 0.0), ("", 0.0)):
        assert play("a", 1, turn1, "b") == (want, "a")


def test_a_policy_ignoring_the_environment_scores_at_chance() -> None:
    """By hand: the prompt is "?*k=" whatever the letter, so a policy that ignores the revealed
    letter answers the same text t for all 5 letters of a count k. Each of t's first k characters
    matches at most one letter, so summed over the letters its answer scores
    sum_c hits_c / max(k, len t) <= k / max(k, len t) <= 1: on average over uniform letters at
    most 1/5, and its reward at most 0.2 x 1 + 0.8 x 1/5 = 0.36. Writing one fixed letter k times
    reaches that bound; answering with the revealed letter scores 1.0."""
    answers = ["".join(p) for n in range(5) for p in itertools.product("ab?x", repeat=n)]
    answers += [c * k for c in LETTERS for k in range(1, MAX_COUNT + 1)] + ["abcde", "edcba" * 3]
    for k in range(1, MAX_COUNT + 1):
        for text in answers:
            total = sum(play(c, k, "?", text)[0] for c in LETTERS)
            assert total <= len(LETTERS) * 0.2 + 0.8 + 1e-12, (k, text)
    # the 20 (letter, count) prompts, each once: blind "a" x k against the revealed letter x k
    combos = [(c, k) for c in LETTERS for k in range(1, MAX_COUNT + 1)]
    blind = [play(c, k, "?", "a" * k)[0] for c, k in combos]
    seeing = [play(c, k, "?", c * k)[0] for c, k in combos]
    assert abs(sum(blind) / len(combos) - 0.36) < 1e-12 and sum(seeing) / len(combos) == 1.0
