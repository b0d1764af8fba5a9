"""k3lab.experiments.nb's notebook helpers: the text progress bar, results over seeds, the explorer's fallback."""
import io
import sys

import pytest

from k3lab.experiments import nb


def test_progress_is_a_text_bar_on_stdout(monkeypatch):
    """The bar writes to sys.stdout (what a notebook saves), and its last state is the finished one."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    for _ in nb.progress(range(7), desc="mixers"):
        pass
    last = out.getvalue().split("\r")[-1]
    assert last.startswith("mixers: 100%|") and "7/7 [" in last


def test_mean_spread_is_mean_and_half_range():
    assert nb.mean_spread([0.5, 0.7, 0.6]) == pytest.approx((0.6, 0.1))
    with pytest.raises(ValueError, match="no values"):
        nb.mean_spread([])


@pytest.mark.parametrize("a, b, status", [
    ([0.60, 0.62, 0.61], [0.50, 0.52, 0.51], "confirmed"),        # gap 0.10 > spread 0.02
    ([0.60, 0.70, 0.50], [0.55, 0.58, 0.52], "not reproduced at this scale"),  # gap 0.05 < spread 0.13
    ([0.40, 0.41, 0.42], [0.60, 0.61, 0.62], "contradicted"),     # b better by 0.20 > 0.02
])
def test_compare_seeds_verdict(a, b, status):
    r = nb.compare_seeds("kda", a, "gdn", b)
    assert r["status"] == status and r["confirmed"] == (status == "confirmed")
    assert r["gap"] == pytest.approx(sum(a) / 3 - sum(b) / 3)
    assert ("exceeds" in r["text"]) == (status != "not reproduced at this scale")


def test_compare_seeds_lower_is_better_flips_the_gap():
    r = nb.compare_seeds("nope", [0.1, 0.1], "rope", [0.3, 0.3], higher_is_better=False)
    assert r["gap"] == pytest.approx(0.2) and r["status"] == "confirmed" and "nope is better" in r["text"]
    with pytest.raises(ValueError, match=">= 2 seeds"):
        nb.compare_seeds("a", [1.0], "b", [2.0])


def test_resolve_interactive(monkeypatch):
    """'auto' follows the Jupyter server's JPY_SESSION_NAME (papermill/nbval kernels have none)."""
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    assert nb.resolve_interactive("auto") is False and nb.resolve_interactive(False) is False
    assert nb.resolve_interactive(True) is True
    monkeypatch.setenv("JPY_SESSION_NAME", "/tmp/03.ipynb")
    assert nb.resolve_interactive("auto") is True
    with pytest.raises(ValueError, match="interactive='yes'.*allowed values"):
        nb.resolve_interactive("yes")


def test_explore_static_fallback_calls_plot_once_with_defaults(monkeypatch, capsys):
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    calls = []
    got = nb.explore(lambda tile, bound: calls.append((tile, bound)), "auto",
                     tile=([8, 16, 32], 16), bound=([-2.0, -5.0], -5.0))
    assert calls == [(16, -5.0)] and got == {"tile": 16, "bound": -5.0}
    assert "static plot at tile=16, bound=-5.0" in capsys.readouterr().out
    with pytest.raises(ValueError, match="control tile="):
        nb.explore(lambda tile: None, False, tile=([8, 16], 64))
