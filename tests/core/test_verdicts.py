"""An LLM judge's verdicts parsed, its templates checked (core/verdicts.py), by hand."""

from __future__ import annotations

from rlhf_batch.core.verdicts import PATTERNS, groups_of, parse_group, parse_pointwise, template_problem


def test_patterns_parse_the_first_score_and_each_numbered_response() -> None:
    # pointwise: the first "Score: N" counts, a decimal and a sign are read, none is None
    assert parse_pointwise("Score: 7\nScore: 9", PATTERNS["pointwise"]) == 7.0
    assert parse_pointwise("so, score = -2.5.", PATTERNS["pointwise"]) == -2.5
    assert parse_pointwise("excellent!", PATTERNS["pointwise"]) is None
    # group of 3: "1: 4", "Response 3: 8"; 2 unscored; 5 is outside 1..3; a repeated 1 is ignored
    text = "1: 4\nResponse 3: 8\n5: 1\n1: 9"
    assert parse_group(text, PATTERNS["group"], 3) == [4.0, None, 8.0]


def test_groups_keep_rows_order_and_templates_name_their_missing_field() -> None:
    # rows of prompts a, b, a, c, b: groups in order of first appearance
    assert groups_of(["a", "b", "a", "c", "b"]) == [[0, 2], [1, 4], [3]]
    assert template_problem("{prompt} {response} {answer}", "pointwise", ["answer"]) == ""
    assert "no field {responses} in pointwise mode" in template_problem("{responses}", "pointwise", [])
    assert "no field {response} in group mode" in template_problem("{response}", "group", [])
    assert "literal brace" in template_problem("{prompt", "pointwise", [])
