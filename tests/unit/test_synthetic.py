"""Synthetic-acceptance benchmark mode: drafts accepted at the configured per-position rates,
with random (dummy) drafter weights loaded from a config alone."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from dspark import LLM, SamplingParams
from dspark.config import SpeculativeConfig
from dspark.testing.drafters import make_tiny_drafter


@pytest.fixture(scope="module")
def config_only_drafter(tiny_qwen, tmp_path_factory):
    full = make_tiny_drafter(str(tmp_path_factory.mktemp("syn_full")), tiny_qwen)
    bare = str(tmp_path_factory.mktemp("syn_bare"))
    shutil.copy(os.path.join(full, "config.json"), bare)  # no weights at all
    return bare


def _run(target, drafter, rates, k=4, n=24, setup=None, **spec):
    cfg = {"model": drafter, "num_speculative_tokens": k, "rejection_sample_method": "synthetic",
           "synthetic_acceptance_rates": rates, **spec}  # fmt: skip
    llm = LLM(target, device="cpu", load_format="dummy", speculative_config=cfg)
    if setup is not None:
        setup(llm.engine.runner.spec)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(range(3, 3 + i % 7 + 2))} for i in range(n)],
                        params)  # fmt: skip
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    return llm


def test_rates_one_and_zero(tiny_qwen, config_only_drafter):
    st = _run(tiny_qwen, config_only_drafter, [1.0] * 4).engine.spec_stats
    assert st.num_accepted_tokens == st.num_verified_tokens == st.num_drafted_tokens > 0
    st = _run(tiny_qwen, config_only_drafter, [0.0] * 4).engine.spec_stats
    assert st.num_accepted_tokens == 0 and st.num_steps > 0


def test_per_position_rates_are_honoured(tiny_qwen, config_only_drafter):
    rates = [0.9, 0.7, 0.5, 0.3]
    st = _run(tiny_qwen, config_only_drafter, rates, n=48).engine.spec_stats
    d = st.as_dict()
    cond = d["conditional_acceptance_per_position"]
    for j, (got, want) in enumerate(zip(cond, rates)):
        tested = st.reached_per_pos[j]
        se = (want * (1 - want) / tested) ** 0.5
        assert abs(got - want) < 5 * se + 1e-9, (j, got, want, tested)
    # acceptance length: 1 + sum of survivals
    expected = 1 + float(np.cumprod(rates).sum())
    assert abs(d["mean_acceptance_length"] - expected) < 0.15


def test_adaptive_trims_low_survival_positions(tiny_qwen, config_only_drafter, tmp_path):
    from dspark.spec.cost_model import CostModel

    path = str(tmp_path / "cost.json")
    CostModel.analytic(weight_read_ms=0.01, ms_per_token=1.0, fixed_overhead_ms=4.0,
                       draft_base_ms=0.0, draft_ms_per_req=0.0).to_json(path)  # fmt: skip
    st = _run(tiny_qwen, config_only_drafter, [0.95, 0.9, 0.3, 0.1],
              adaptive_policy="lagged", cost_table_path=path,
              min_predicted_gain=0.0).engine.spec_stats
    assert st.verified_per_pos[0] > 0
    assert st.verified_per_pos[3] < 0.5 * st.verified_per_pos[0]  # deep slots mostly trimmed


def test_plain_steps_sample_plainly_in_synthetic_mode(tiny_qwen, config_only_drafter, tmp_path,
                                                     monkeypatch):
    """Steps without drafts (drafting skipped) draw the argmax by plain sampling, the kernels of
    a no-speculation step, not through the synthetic verifier; drafted steps use the latter."""
    import dspark.spec.decoder as decoder_mod
    from dspark.spec.cost_model import CostModel

    path = str(tmp_path / "cost.json")  # the drafter costs 20 ms a step: drafting is skipped
    CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.001, fixed_overhead_ms=0.0,
                       draft_base_ms=20.0, draft_ms_per_req=0.0).to_json(path)  # fmt: skip
    calls = []
    for name in ("sample_step", "verify_synthetic"):
        fn = getattr(decoder_mod, name)
        monkeypatch.setattr(decoder_mod, name, lambda *a, _fn=fn, _n=name, **k: (
            calls.append(_n), _fn(*a, **k))[1])
    st = _run(tiny_qwen, config_only_drafter, [0.5] * 4, adaptive_policy="lagged",
              cost_table_path=path).engine.spec_stats
    assert st.num_steps > 0 and "verify_synthetic" in calls  # probes still verify drafts
    assert calls.count("sample_step") > 5 * calls.count("verify_synthetic")


@pytest.mark.parametrize("bad", [None, [0.5] * 3, [1.5] * 4, "x"])
def test_rates_are_validated(bad):
    with pytest.raises(ValueError, match="synthetic_acceptance_rates"):
        SpeculativeConfig(model="d", num_speculative_tokens=4, rejection_sample_method="synthetic",
                          synthetic_acceptance_rates=bad)  # fmt: skip
    with pytest.raises(ValueError, match="synthetic"):
        SpeculativeConfig(model="d", synthetic_acceptance_rates=[0.5] * 7)


def test_drafting_decision_checks_confidences_against_accepted_drafts(tiny_qwen,
                                                                      config_only_drafter,
                                                                      tmp_path):  # fmt: skip
    """The drafting decision's acceptance ratio pairs each decision step's predicted accepted
    drafts (its rows' stale confidences, at the lengths verified) with the drafts that step
    accepted. Synthetic confidences are the true rates: the ratio is ~1. Confidences that
    understate the rates (x 0.6 each) make it ~2 (its bound); the output is unchanged."""
    from dspark.spec.cost_model import CostModel

    path = str(tmp_path / "cost.json")  # drafting nearly free: every step drafts
    CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.001, fixed_overhead_ms=0.0,
                       draft_base_ms=0.0, draft_ms_per_req=0.0).to_json(path)  # fmt: skip
    rates = [0.9, 0.8, 0.7, 0.6]
    checked = []

    def count_checks(spec):
        observe = spec.drafting.observe_acceptance
        spec.drafting.observe_acceptance = lambda *a: (checked.append(a), observe(*a))[1]

    llm = _run(tiny_qwen, config_only_drafter, rates, n=48, setup=count_checks,
               adaptive_policy="lagged", cost_table_path=path)  # fmt: skip
    drafting = llm.engine.runner.spec.drafting
    assert len(checked) >= 4 and sum(a[2] for a in checked) > 100
    assert drafting.acceptance_ratio(True) == pytest.approx(1.0, abs=0.15)

    def understate(spec):
        count_checks(spec)
        draft = spec.draft

        def draft_understated(anchors, anchor_pos, block_tables, temperature, seeds, rounds,
                              slots, *rest, **kw):  # fmt: skip
            draft(anchors, anchor_pos, block_tables, temperature, seeds, rounds, slots,
                  *rest, **kw)  # fmt: skip
            spec.conf[slots] *= 0.6

        spec.draft = draft_understated

    checked.clear()
    llm = _run(tiny_qwen, config_only_drafter, rates, n=48, setup=understate,
               adaptive_policy="lagged", cost_table_path=path)  # fmt: skip
    assert len(checked) >= 4
    drafting = llm.engine.runner.spec.drafting
    assert drafting.acceptance_ratio(True) > 1.7
    # position by position the estimate recovers the true survival (0.9, 0.72: the rates'
    # products), where the one ratio (its bound, 2) made it 1.0, 0.52
    np.testing.assert_allclose(drafting.estimate(True)[:2], [0.9, 0.72], rtol=0.15)
