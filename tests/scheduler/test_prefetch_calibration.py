"""The prefetcher's precision by rank: learned from outcomes, a neutral prior, decay."""
import pytest

from scheduler.prefetch import RankCalibration


def test_cold_start_is_neutral_and_beyond_tracked_ranks_uses_the_last():
    c = RankCalibration(3)
    assert c.precisions() == [0.5, 0.5, 0.5]
    assert c.precision(10) == c.precision(2)


def test_precision_follows_which_ranks_were_used():
    c = RankCalibration(4, half_life=1e9)
    for _ in range(98):
        c.observe([7, 3, 5, 1], {7, 3, 9})          # ranks 0 and 1 used, 2 and 3 not
    assert c.precision(0) == pytest.approx(99 / 100)
    assert c.precision(1) == pytest.approx(99 / 100)
    assert c.precision(2) == pytest.approx(1 / 100)
    assert c.observations == 98


def test_old_outcomes_fade_with_the_half_life():
    c = RankCalibration(1, half_life=10)
    for _ in range(200):
        c.observe([0], {0})
    for _ in range(30):                            # the predictor turns bad
        c.observe([0], set())
    assert c.precision(0) < 0.2


def test_short_predictions_only_count_the_ranks_they_have():
    c = RankCalibration(3, half_life=1e9)
    c.observe([4], {4})
    assert c.precision(0) == pytest.approx(2 / 3)
    assert c.precision(1) == 0.5


@pytest.mark.parametrize("args", [(0,), (2, 0.0), (2, -1.0)])
def test_bad_arguments(args):
    with pytest.raises(ValueError):
        RankCalibration(*args)
