import pytest

from bench.quality import QualityConfig, _mean, _targets


def test_seeds_default_to_the_single_seed_and_parse_a_list() -> None:
    assert QualityConfig(seed=3).seed_list() == [3]
    assert QualityConfig(seeds="0,1,2").seed_list() == [0, 1, 2]


@pytest.mark.parametrize("seeds", ["0,x", "1,1", "-1"])
def test_bad_seeds_are_refused_with_a_message(seeds: str) -> None:
    with pytest.raises(ValueError, match="--seeds"):
        QualityConfig(seeds=seeds).seed_list()


def test_methods_keep_their_canonical_order_and_refuse_unknown_names() -> None:
    assert QualityConfig(methods="async_uncorrected,async").method_list() == [
        "async",
        "async_uncorrected",
    ]
    with pytest.raises(ValueError, match="--methods"):
        QualityConfig(methods="async,bogus").method_list()


def test_fixed_h_is_a_sizing() -> None:
    assert QualityConfig(hetero="1,2,4", sizing="fixed-h").speeds() == [1.0, 2.0, 4.0]


def test_targets_say_how_much_the_correction_gained_and_tolerate_missing_runs() -> None:
    figures = {"async_val_loss": 2.4, "sync_val_loss": 3.0, "async_uncorrected_val_loss": 2.5}
    targets = _targets(figures)
    assert targets["async_vs_sync"] == 0.8
    assert targets["async_5pct_below_sync"] is True
    assert targets["correction_gain"] == pytest.approx(0.04)
    assert targets["corrected_below_uncorrected"] is True

    no_sync = _targets(figures | {"sync_val_loss": None})
    assert no_sync["async_vs_sync"] is None and no_sync["correction_gain"] == pytest.approx(0.04)


def test_mean_skips_runs_not_made() -> None:
    assert _mean([2.0, None, 3.0]) == 2.5
    assert _mean([None]) is None


def test_the_corrected_run_takes_a_correction_with_its_own_default_strength() -> None:
    assert QualityConfig().strength() == 10.0  # heloco: at 1 it barely acts
    assert QualityConfig(correction="lookahead").strength() == 1.0
    assert QualityConfig(correction="lookahead", correction_strength=0.5).strength() == 0.5
    with pytest.raises(ValueError, match="--correction"):
        QualityConfig(correction="none").strength()
