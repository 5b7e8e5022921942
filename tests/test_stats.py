
import pytest

from moebench.scoring.answers import (cut_at_stop, extract_gsm8k, first_stop, gsm8k_reference, normalize_number,
                                      numbers_equal)
from moebench.scoring.stats import mcnemar_exact_p, paired_bootstrap_ci, wilson_ci


def test_mcnemar_exact_values():
    assert mcnemar_exact_p(0, 0) == 1.0
    assert mcnemar_exact_p(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact_p(5, 0) == pytest.approx(2 / 32)
    # 2 wins, 8 losses: 2 * P(X <= 2 | n=10) = 2 * (1 + 10 + 45) / 1024
    assert mcnemar_exact_p(2, 8) == pytest.approx(2 * 56 / 1024)
    assert mcnemar_exact_p(5, 5) == 1.0
    assert mcnemar_exact_p(300, 250) < 0.05


def test_bootstrap_ci_brackets_the_difference():
    base = [True] * 60 + [False] * 40
    cand = [True] * 50 + [False] * 50
    lo, hi = paired_bootstrap_ci(base, cand, n_boot=500)
    assert lo < -0.1 + 1e-9 < hi or lo <= -0.1 <= hi
    assert hi < 0.05
    assert paired_bootstrap_ci(base, base, n_boot=100) == (0.0, 0.0)


def test_wilson_ci():
    lo, hi = wilson_ci(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)


@pytest.mark.parametrize("text,expected", [
    ("so 5 + 3 = 8\n#### 1,234.00", "1234"),
    ("The answer is $18.", "18"),
    ("I think it is 3 or maybe -4.5", "-4.5"),
    ("no numbers here", None),
])
def test_gsm8k_extraction(text, expected):
    assert extract_gsm8k(text)[0] == expected


@pytest.mark.parametrize("text,stops,expected", [
    ("abcQuestion:x</s>", ["Question:", "</s>"], 3),
    ("ab</s>Question:", ["Question:", "</s>"], 2),      # the earliest hit, whatever the stops' order
    ("Question:", ["Question:"], 0),
    ("abc", [], None),
    ("abc", [""], None),                                # an empty stop never matches
    ("abc", ["zz", "", "c"], 2),
])
def test_first_stop_is_the_earliest_hit(text, stops, expected):
    assert first_stop(text, stops) == expected
    assert cut_at_stop(text, stops) == (text if expected is None else text[:expected])


def test_number_normalisation():
    assert normalize_number("1,234.00") == "1234"
    assert numbers_equal("1234", normalize_number("1,234.00"))
    assert normalize_number("$5.") == "5"
    assert normalize_number("0.50") == "0.5"
    assert gsm8k_reference("blah\n#### 1,000") == "1000"
    assert not numbers_equal(None, "3")
