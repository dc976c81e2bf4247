"""What an adaptive engine observed and decided, step by step, for a sweep's diagnosis
(offline_sweep.py --step-log): one JSON line per observed step (the period its online cost
model learned from, the residual over its table, its kind and batch size), per step it did not
learn from ("unobserved": steps with prefill chunks among them; period, requests, tokens) and
per drafting verdict (the rates, the fixed terms, the request count they were learned at,
whether plain decoding at its cheapest, plain_best tokens/ms, could win: a plain probe may
follow), each with the level it came from. Steps whose period the engine does not keep at
all (a call that captured a graph or committed two steps) are in neither. A wrapper on the
decoder's own calls: the engine runs as it would (a dict and an append per step, ~1 µs, on
the speculative arms only; fixed K's steps all come as "unobserved": it learns no costs)."""

from __future__ import annotations

import json


class StepLog:
    """Records of one engine's speculative decoder into `path` (appended, JSON lines);
    `level` labels the records until set again."""

    def __init__(self, engine, arm: str, path: str) -> None:
        self.arm, self.level, self.records = arm, None, []
        self._path = path
        spec = engine.runner.spec
        observe, pays = spec.observe_step_time, spec.drafting._pays

        def logged_observe(step_ms, num_tokens, num_reqs, tag):
            observe(step_ms, num_tokens, num_reqs, tag)
            if not num_reqs:
                return
            if tag is None:  # a step the cost model does not learn from (prefill chunks
                # beside the rows, a probe's verification): its period all the same
                self._add("unobserved", ms=round(step_ms, 4), reqs=num_reqs, tokens=num_tokens)
            else:
                residual = spec.step_residual_ms(step_ms, num_tokens, tag)
                self._add("step", kind=tag[0], greedy=tag[2], ms=round(step_ms, 4),
                          residual=round(residual, 4), reqs=num_reqs,
                          tokens=num_tokens)  # fmt: skip

        def logged_pays(cost, fixed, num_sampling):
            verdict = pays(cost, fixed, num_sampling)
            nums = spec.drafting._numbers
            if nums is not None:  # (n, spec rate, plain rate, spec term, plain term, at, ...)
                self._add("verdict", reqs=num_sampling, greedy=fixed.greedy, pays=verdict,
                          state=spec.drafting.pays, spec_rate=round(nums[1], 3),
                          plain_rate=round(nums[2], 3), spec_fixed=round(nums[3], 4),
                          plain_fixed=None if nums[4] is None else round(nums[4], 4),
                          plain_at=nums[5], spec_age=fixed.age("spec", num_sampling),
                          plain_age=fixed.age("plain", num_sampling),
                          may_win=spec.drafting._plain_may_win,
                          plain_best=round(spec.drafting._plain_best, 3))  # fmt: skip
            return verdict

        spec.observe_step_time = logged_observe
        spec.drafting._pays = logged_pays

    def _add(self, what: str, **fields) -> None:
        self.records.append(dict(arm=self.arm, level=self.level, what=what, **fields))

    def flush(self) -> None:
        """Append the records so far to the file (between levels, off the measured time)."""
        if self.records:
            with open(self._path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.records)
            self.records = []
