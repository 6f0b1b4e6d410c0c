"""Per-token versions of a vLLM completion from its weight-version spans (rollout/vllm_engine.py:token_versions),
without vLLM: a token no span covers must never look fresher than it can be."""

from a3po.rollout.vllm_engine import token_versions


def test_spans_that_cover_every_token_give_each_its_version():
    versions, missing = token_versions([("2", 0, 3), ("3", 3, 5)], 5, submitted=2)
    assert versions == [2, 2, 2, 3, 3] and missing == 0


def test_tokens_no_span_covers_get_the_version_at_submission_not_a_later_one():
    # submitted at version 1; the engine is at version 4 when the request finishes
    assert token_versions([], 3, submitted=1) == ([1, 1, 1], 3)
    assert token_versions([("4", 2, 4)], 4, submitted=1) == ([1, 1, 4, 4], 2)


def test_a_span_past_the_last_token_is_clipped_to_the_tokens():
    versions, missing = token_versions([("0", 0, 2), ("1", 2, 9)], 4, submitted=0)
    assert versions == [0, 0, 1, 1] and missing == 0
