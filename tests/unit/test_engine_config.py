"""EngineConfig: the step's token budget when none is given. Verify rows take 1 + K tokens
each, so with speculation the default grows by every row's K draft slots: at max_num_seqs
rows a prompt is still admitted in chunks of the plain default, never starved by drafts."""

import pytest

from dspark.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig


def test_the_default_budget_without_speculation():
    assert EngineConfig(model="m").max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS


@pytest.mark.parametrize("seqs,k", [(256, 7), (8, 3)])
def test_the_default_budget_leaves_the_plain_budget_beside_every_rows_drafts(seqs, k):
    spec = {"model": "d", "num_speculative_tokens": k}
    cfg = EngineConfig(model="m", max_num_seqs=seqs, speculative_config=spec)
    assert cfg.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS + seqs * k


def test_a_given_budget_is_kept_with_speculation():
    spec = {"model": "d", "num_speculative_tokens": 7}
    cfg = EngineConfig(model="m", max_num_batched_tokens=1024, speculative_config=spec)
    assert cfg.max_num_batched_tokens == 1024


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "big"])
def test_a_bad_budget_names_the_field(bad):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model="m", max_num_batched_tokens=bad)
