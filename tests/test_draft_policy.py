"""When an n-gram draft pays (`chatbot.engine.speculative.DraftPolicy`): the cost of a pass
from the timings given to it, the acceptance from the drafts kept and the lookups declined,
and, over simulated answers with a fixed cost per pass (no clock), that text which never
repeats itself decodes at >= 0.95x plain decoding while a repeated text gains."""

from __future__ import annotations

import random

import pytest

from chatbot.engine.speculative import PRIOR_FIXED, PRIOR_ROW, DraftPolicy, NgramDrafter


def test_the_cost_of_a_pass_comes_from_the_timings():
    policy = DraftPolicy()
    assert policy.cost(4) == pytest.approx(PRIOR_FIXED + 4 * PRIOR_ROW)
    policy.step_took(0.010)
    policy.pass_took(3, 0.020)
    assert policy.cost(3) == pytest.approx(2.0)
    assert policy.cost(5) == pytest.approx(2.0 + 2 * PRIOR_ROW)  # one size timed: the prior slope
    policy.pass_took(5, 0.040)
    assert policy.cost(5) == pytest.approx(4.0)
    assert policy.cost(9) == pytest.approx(8.0)  # on the line through (3, 2) and (5, 4)


def test_the_length_follows_acceptance_and_cost():
    policy = DraftPolicy()
    policy.step_took(1.0)
    for rows in (2, 9):
        policy.pass_took(rows, 0.5 + 0.25 * rows)  # cheap rows: a memory-bound model
    for _ in range(20):
        policy.observe(8, 8)
    assert policy.acceptance > 0.9 and policy.length(8) == 8
    for _ in range(20):
        policy.observe(8, 0)
    assert policy.acceptance < 0.1 and policy.length(8) == 0
    costly = DraftPolicy()
    costly.step_took(1.0)
    for rows in (2, 9):
        costly.pass_took(rows, float(rows))  # a pass of k rows costs k steps: never pays
    for _ in range(20):
        costly.observe(8, 8)
    assert costly.length(8) == 0


def test_a_declined_lookup_is_checked_against_the_plain_tokens():
    drafter = NgramDrafter([1, 2, 3, 4, 5, 9, 1, 2], max_tokens=4)
    drafter.policy.observe(10, 0)  # acceptance low: the lookup is declined
    before = drafter.policy.acceptance
    assert drafter.propose(4) == [] and drafter.shadow == [3, 4, 5, 9]
    drafter.extend([3, 4, 5, 9])  # the answer went on as the lookup said
    assert drafter.shadow == [] and drafter.policy.acceptance > before


def _simulate(answer: list[int], prompt: list[int], cost, max_tokens: int = 8) -> tuple[float, float, int]:
    """Decode `answer` with drafts, a pass of k rows costing cost(k) steps: its speed against
    plain decoding (tokens per step), the share of draft tokens kept, and the passes run."""
    drafter = NgramDrafter(prompt, max_tokens)
    time = 0.0
    done = drafted = kept_all = passes = 0
    drafter.extend(answer[:1])
    done = 1
    while done < len(answer):
        draft = drafter.propose(len(answer) - done - 1)
        if not draft:
            time += 1.0
            drafter.policy.step_took(1.0)
            drafter.extend(answer[done : done + 1])
            done += 1
            continue
        passes += 1
        time += cost(len(draft) + 1)
        drafter.policy.pass_took(len(draft) + 1, cost(len(draft) + 1))
        kept = 0
        while kept < len(draft) and answer[done + kept] == draft[kept]:
            kept += 1
        drafter.rejected(len(draft), kept)
        drafted, kept_all = drafted + len(draft), kept_all + kept
        drafter.extend(answer[done : done + kept + 1])
        done += kept + 1
    return (len(answer) - 1) / time, kept_all / max(drafted, 1), passes


@pytest.mark.parametrize("cost", [lambda k: 0.6 + 0.45 * k, lambda k: 0.3 + 0.55 * k, lambda k: 0.8 * k])
def test_free_text_stays_near_plain_speed_and_a_repeated_text_gains(cost):
    rng = random.Random(0)
    vocab = list(range(60))  # small: bigrams repeat by chance, and what follows them does not
    prompt = [rng.choice(vocab) for _ in range(300)]
    free = [rng.choice(vocab) for _ in range(400)]
    speed, _, _ = _simulate(free, prompt, cost)
    assert speed >= 0.95
    repeat = prompt[50:250] + [rng.choice(vocab) for _ in range(20)] + prompt[120:300]
    speed, accepted, passes = _simulate(repeat, prompt, cost)
    ceiling = max(k / cost(k) for k in range(2, 10))  # every draft token kept
    assert passes > 10 and accepted > 0.7 and speed > max(1.15, 0.85 * ceiling)
