"""McNemar's exact test on paired per-prompt correctness (analyzer/stats/mcnemar.py), against scipy's binomial test and
an exact enumeration written here, and on constructed answer sets whose p-values are known by hand."""

from __future__ import annotations

import itertools
from fractions import Fraction
from math import comb

import pytest

from kvtrace.analyzer.stats import mcnemar


def enumerated_p(b: int, c: int) -> Fraction:
    """Two-sided exact binomial(n, 1/2) test by its definition: the probability of every split no more likely
    than the observed one."""
    n = b + c
    probability = [Fraction(comb(n, k), 2 ** n) for k in range(n + 1)]
    return sum((p for p in probability if p <= probability[b]), Fraction(0))


DISCORDANT = [(b, c) for b, c in itertools.product(range(0, 13), repeat=2)] + [
    (50, 70), (70, 50), (0, 200), (311, 340), (600, 719), (17, 1302)]


@pytest.mark.parametrize("b,c", DISCORDANT)
def test_mcnemar_matches_the_enumerated_definition(b, c):
    want = 1.0 if b + c == 0 else float(min(Fraction(1), enumerated_p(b, c)))
    assert mcnemar.mcnemar_exact(b, c) == pytest.approx(want, rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("b,c", DISCORDANT)
def test_mcnemar_matches_scipy_binomtest(b, c):
    scipy_stats = pytest.importorskip("scipy.stats")
    if b + c == 0:
        assert mcnemar.mcnemar_exact(b, c) == 1.0
        return
    assert mcnemar.mcnemar_exact(b, c) == pytest.approx(scipy_stats.binomtest(b, b + c, 0.5).pvalue, rel=1e-9)


def test_constructed_answer_sets():
    # Identical answers: nothing discordant, no evidence of a difference.
    same = mcnemar.paired_accuracy([True, False, True, True], [True, False, True, True])
    assert (same.baseline_only, same.candidate_only, same.p_value, same.verdict) == (0, 0, 1.0,
                                                                                    mcnemar.AccuracyVerdict.SAME)
    # The candidate loses 10 prompts the baseline got and wins none: p = 2 / 2**10.
    base = [True] * 10 + [False] * 5 + [True] * 85
    cand = [False] * 10 + [False] * 5 + [True] * 85
    lost = mcnemar.paired_accuracy(base, cand)
    assert (lost.baseline_correct, lost.candidate_correct, lost.baseline_only, lost.candidate_only) == (95, 85, 10, 0)
    assert lost.p_value == 2 / 1024 and lost.verdict == mcnemar.AccuracyVerdict.DIFFERS
    assert lost.baseline_accuracy == 0.95 and lost.candidate_accuracy == 0.85
    # 1 against 9: p = 2 (1 + 9 + ... ) -> 2 * (C(10,0) + C(10,1)) / 2**10.
    one_nine = mcnemar.paired_accuracy([True] + [False] * 9, [False] + [True] * 9)
    assert one_nine.p_value == 2 * 11 / 1024
    # The same accuracies with many more disagreements are weaker evidence: pairing matters, not the totals.
    swapped = mcnemar.paired_accuracy([True] * 30 + [False] * 20 + [True] * 50,
                                      [False] * 20 + [True] * 10 + [True] * 20 + [True] * 50)
    assert swapped.baseline_correct == 80 and swapped.candidate_correct == 100 - 20
    assert swapped.p_value == 1.0  # 20 against 20


def test_paired_accuracy_refuses_unpaired_input():
    with pytest.raises(ValueError, match="as many prompts"):
        mcnemar.paired_accuracy([True], [True, False])
    with pytest.raises(ValueError, match="non-negative"):
        mcnemar.mcnemar_exact(-1, 3)
