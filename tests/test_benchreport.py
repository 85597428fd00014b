"""The benchmark's report: a headline only when the rounds agree, flags, and a figure that shows them all."""
from __future__ import annotations

from dali_pipe.benchreport import figure, flags, ratio_lines, sig


def _spread(*rounds):
    return {"median": sorted(rounds)[len(rounds) // 2], "min": min(rounds), "max": max(rounds), "rounds": list(rounds)}


def test_a_headline_only_when_every_round_agrees():
    """Rounds on both sides of 1, rounds far apart, a single round or a flagged run give 'no clear winner' with the
    range; rounds that agree give the headline with its spread."""
    def line(r, disturbed=False):
        return ratio_lines({"dali_vs_baseline": r}, cores=2, model=True, disturbed=disturbed)[0]

    assert line(_spread(0.85, 1.65)) == ("no clear winner between dali and the classic DataLoader on 2 core(s): "
                                         "dali/baseline was 0.85-1.6x over 2 round(s) (the rounds fall on both sides "
                                         "of 1).")
    assert "differ by more than 25%" in line(_spread(1.2, 1.9))
    assert "one round shows no spread" in line(_spread(1.5))
    assert "the run was flagged" in line(_spread(1.5, 1.6), disturbed=True)
    assert line(_spread(1.5, 1.62, 1.55)) == ("dali delivers 1.6x (1.5-1.6) the images/s of the classic DataLoader on "
                                              "2 core(s), every one of 3 rounds agreeing.")
    assert sig(2123) == "2100" and sig(1.53) == "1.5" and sig(0.853) == "0.85" and sig(0.0) == "0"


def _report():
    loader = {"images_per_sec_rounds": _spread(1.4, 1.53), "data_wait_fraction": 0.001, "time_budget": None,
              "other_load_cores": 0.0, "other_load_cores_rounds": [0.0, 1.1]}
    ratio = {"dali_vs_baseline": _spread(0.85, 1.65), "dali_vs_synthetic": _spread(1.2, 1.3)}
    found = flags({"dali": loader, "baseline": {**loader, "other_load_cores_rounds": [0.0, 0.0]}}, ratio, cores=2,
                  model=True)
    return {"env": {"gpu": None, "cpus": 2}, "config": {"model": "tiny", "batch_size": 8, "repeat": 2},
            "loaders": {"dali": loader, "baseline": {**loader, "images_per_sec_rounds": _spread(0.9, 1.77)}},
            "ratios": ratio, "flags": found,
            "diagnosis": ratio_lines(ratio, cores=2, model=True, disturbed=bool(found)),
            "timelines": {n: {"gpu": [], "wait_ms": [1.0, 2.0]} for n in ("dali", "baseline")}}


def test_the_figure_shows_two_digits_the_spread_and_every_flag_of_the_text():
    """Bars labelled to 2 significant digits with their min-max (not '1, 1, 0'); the verdict and every flag of the
    text (busy cores in any round, faster than the synthetic ceiling) written on the figure."""
    import matplotlib.pyplot as plt

    rep = _report()
    assert len(rep["flags"]) == 2 and "faster than the synthetic-data ceiling" in rep["flags"][1]
    fig = figure(rep)
    shown = " ".join(" ".join(t.get_text().split()) for t in fig.texts)
    for line in rep["flags"]:
        assert "warning: " + " ".join(line.split()) in shown, line
    assert "no clear winner between dali and the classic DataLoader" in shown
    labels = [t.get_text() for t in fig.axes[1].texts]
    assert labels == ["1.5\n(1.4-1.5)", "1.8\n(0.90-1.8)"], labels
    plt.close(fig)
