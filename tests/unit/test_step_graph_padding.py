"""Steps with prefill chunks whose rows verify nothing ("mixed_plain") run no-spec's work
for their rows: one LM-head row a request, and the paged attention's 1-token tile for the
decode rows. A speculative engine's such steps had run the LM head over 1 + K rows a
request and a tile for 1 + K tokens a row: on the 8B shape at ~250 rows the LM head alone
cost ~4.4 ms a step (twenty-ninth session, step logs)."""

import pytest

from dspark import SamplingParams
from dspark.testing.drafters import make_tiny_drafter
from tests.unit.test_step_graph import MAX_TOKENS, PROMPTS, SPECS, _llm


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    return make_tiny_drafter(str(tmp_path_factory.mktemp("sgp_drafter")), tiny_qwen, seed=3)


@pytest.mark.parametrize("name", ["lagged", "fixed", "synthetic", "nospec"])
def test_steps_with_prefill_but_no_drafts_take_one_logits_row_per_request(tiny_qwen, drafter,
                                                                        name):  # fmt: skip
    """A step with prefill chunks whose rows verify nothing ("mixed_plain": the prompts'
    first step, or any admission while drafting is off) samples at most one token a row, so
    its graph runs the LM head over one row per request of its bucket, not 1 + K (on an
    8B-shaped target at 256 rows those 7 padding rows each cost ~4.4 ms a step)."""
    spec = None if SPECS[name] is None else {"model": drafter, **SPECS[name]}
    llm = _llm(tiny_qwen, spec, step_graphs=True)
    sg, model = llm.engine.runner.step_graphs, llm.engine.runner.model
    step, logits_rows, key_now = sg._step, [], []
    compute = model.compute_logits

    def spy_step(key):
        key_now[:] = [key]
        return step(key)

    def spy_logits(hidden):
        if key_now and key_now[0][0] == "mixed_plain":
            logits_rows.append((key_now[0], hidden.shape[0]))
        return compute(hidden)

    sg._step, model.compute_logits = spy_step, spy_logits
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, seed=11 + i)
              for i, m in enumerate(MAX_TOKENS)]  # fmt: skip
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert logits_rows, "no step with prefill chunks took the padded path"
    assert all(rows == key[1] for key, rows in logits_rows), logits_rows


def test_steps_with_prefill_but_no_drafts_attend_decode_rows_with_the_one_token_tile(
        tiny_qwen, drafter):  # fmt: skip
    """The paged attention gives a step's decode / verify rows their own launch, tiled for the
    engine's 1 + K tokens a row. Where no row verifies ("mixed_plain"), every decode row has
    one token: such a step's attention metadata says so (short_query_len 1, the tile no-spec
    uses), while steps whose rows verify keep the engine's bound (None)."""
    spec = {"model": drafter, **SPECS["fixed"]}
    llm = _llm(tiny_qwen, spec, step_graphs=True)
    runner = llm.engine.runner
    sg, backend = runner.step_graphs, runner.backend
    step, seen, key_now = sg._step, [], []

    def spy_step(key):
        key_now[:] = [key]
        return step(key)

    def spy(method):
        def wrapped(*args):
            md = next(a for a in args if hasattr(a, "short_query_len"))
            if key_now:
                seen.append((key_now[0][0], md.short_query_len))
            return method(*args)

        return wrapped

    sg._step = spy_step
    backend.forward, backend.attend = spy(backend.forward), spy(backend.attend)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, seed=11 + i)
              for i, m in enumerate(MAX_TOKENS)]  # fmt: skip
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    by_family = {}
    for family, short in seen:
        by_family.setdefault(family, set()).add(short)
    assert by_family.get("mixed_plain") == {1}, by_family
    assert by_family.get("spec") == {None}, by_family
