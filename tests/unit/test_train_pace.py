"""The trainers' LR schedule follows the step count, not the machine's speed, unless the time
budget binds (dspark/train/target_trainer.py: Pace). Before, progress was the larger of the
step and time fractions from the first step on, so a slower compile or start moved the
schedule of the first ~200 steps of every run (forty-third session: two H100 runs of the same
seeds, steps and corpus ended 0.09 nats apart, their losses parting by step 50)."""

import pytest

from dspark.train.target_trainer import Pace

STEPS, BUDGET = 1350, 180.0


def schedule(start_s: float, step_s: float, steps: int = STEPS, budget: float = BUDGET):
    """Progress at each step on a machine that takes start_s for the first step (compile,
    warm-up) and step_s for every later one; stops where progress reaches 1, as the
    trainers do."""
    pace, out = Pace(steps, budget), []
    for step in range(steps):
        elapsed = 0.0 if step == 0 else start_s + (step - 1) * step_s
        p = pace.progress(step, elapsed)
        if p >= 1.0:
            break
        out.append(p)
    return out


def test_machines_on_pace_get_the_same_schedule_whatever_their_speed():
    # the two H100 runs: 2 and 3 s to the first step, then ~0.12 s a step (163 s in all);
    # and a machine 1.3x slower still within the 180-s budget
    runs = [schedule(2.0, 0.119), schedule(3.0, 0.120), schedule(6.0, 0.128)]
    assert all(len(r) == STEPS for r in runs)
    assert runs[0] == runs[1] == runs[2] == [s / STEPS for s in range(STEPS)]


def test_the_old_rule_moved_the_schedule_with_the_start():
    """(What the fix is for: max(step fraction, elapsed / budget) from step 0.)"""
    def old(start_s):
        return [max(s / STEPS, (0.0 if s == 0 else start_s + (s - 1) * 0.12) / BUDGET)
                for s in range(STEPS)]  # fmt: skip
    assert old(2.0)[30] != old(3.0)[30] and old(3.0)[30] > 30 / STEPS


@pytest.mark.parametrize("step_s", [0.2, 0.5])
def test_a_slow_machine_decays_the_schedule_within_its_budget(step_s):
    run = schedule(3.0, step_s)
    # it stops when the budget is spent, short of its steps ...
    assert len(run) < STEPS
    assert 3.0 + (len(run) - 1) * step_s <= BUDGET + step_s
    # ... having decayed the schedule to its end: monotone, no jump, reaching ~1 at the end
    assert all(b >= a for a, b in zip(run, run[1:]))
    assert max(b - a for a, b in zip(run, run[1:])) < 5 * step_s / BUDGET
    assert run[-1] > 0.97


def test_no_budget_is_steps_only_and_a_spent_budget_stops_at_once():
    assert [Pace(10, None).progress(s, 1e6) for s in range(10)] == [s / 10 for s in range(10)]
    assert Pace(10, 0).progress(3, 1e6) == 0.3
    # the budget gone in the warm-up steps: stop there
    assert Pace(STEPS, BUDGET).progress(5, BUDGET + 1) >= 1.0
