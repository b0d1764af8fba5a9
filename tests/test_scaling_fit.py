"""k3lab/experiments/scaling_fit.py: Huber power-law fits recover known laws, the bootstrap intervals cover the
truth, the compute multiplier recovers a known compute shift and KL §5.3's published pair, and the verdict rule
and the input checks say what they should."""

import math

import numpy as np
import pytest

from k3lab.experiments import scaling_fit as sf
from k3lab.experiments.scaling_fit import (Multiplier, PowerLawFit, bootstrap_fits, compute_multiplier,
                                           fit_power_law, mean_interval, synthetic_runs, verdict)

# KL §5.3 (Fig. 5, Table 2): C in PFLOP/s-days; HP-2's five sizes (docs/claims.md), C = 6·N_active·D.
KL_MLA = (2.3092, 0.0536)
KL_KIMI_LINEAR = (2.2879, 0.0527)
KL_SIZES = [(653e6, 38.8e9), (878e6, 59.8e9), (1.1e9, 85.2e9), (1.4e9, 102.5e9), (1.7e9, 128.0e9)]
KL_COMPUTE = [6 * n * d / sf.PFLOPS_DAY for n, d in KL_SIZES]     # 1.76 … 15.1 PFLOP/s-days


def rel(a, b):
    return abs(a / b - 1)


# ------------------------------------------------------------------------------------------------ fits
def test_fit_recovers_exact_power_law():
    C = np.geomspace(1e15, 1e19, 6)
    L = 2.3 * C ** -0.05
    fit = fit_power_law(C, L)
    assert rel(fit.A, 2.3) < 1e-6 and rel(fit.alpha, 0.05) < 1e-6
    assert fit.E == 0.0 and fit.n == 6 and fit.huber_loss < 1e-20 and not fit.irreducible
    np.testing.assert_allclose(fit.predict(C), L, rtol=1e-9)
    assert rel(fit.compute_at(2.3 * 3e16 ** -0.05), 3e16) < 1e-6      # the inverse
    assert isinstance(fit.predict(1e16), float)


def test_fit_recovers_irreducible_term_over_a_wide_range():
    C = np.geomspace(1e13, 1e21, 9)                                    # 8 decades: the curve bends visibly
    L = 1.7 + 400 * C ** -0.15
    fit = fit_power_law(C, L, irreducible=True)
    assert rel(fit.E, 1.7) < 1e-6 and rel(fit.A, 400) < 1e-6 and rel(fit.alpha, 0.15) < 1e-6
    assert rel(fit.compute_at(1.8), (400 / 0.1) ** (1 / 0.15)) < 1e-6
    # noisy (0.3% per run, 3 seeds): E within 2% and inside its 95% interval
    runs = synthetic_runs(400, 0.15, E=1.7, sizes_compute=C, noise=0.003, seed=1)
    boot = bootstrap_fits(runs, irreducible=True, n_boot=200)
    lo, hi = boot.interval("E")
    assert rel(boot.point.E, 1.7) < 0.02 and lo <= 1.7 <= hi
    lo, hi = boot.interval("alpha")
    assert lo <= 0.15 <= hi


def test_least_squares_limit_is_ordinary_regression():
    runs = synthetic_runs(3.0, 0.07, noise=0.02, seed=4)
    C, L = [r["compute"] for r in runs], [r["loss"] for r in runs]
    slope, intercept = np.polyfit(np.log(C), np.log(L), 1)
    fit = fit_power_law(C, L, delta=1e9)
    assert rel(fit.alpha, -slope) < 1e-9 and rel(fit.A, math.exp(intercept)) < 1e-9


def test_huber_is_robust_to_one_outlier_where_least_squares_moves():
    C = np.geomspace(1e15, 1e19, 8)
    L = 2.3 * C ** -0.05
    L[-1] *= 1.05                                                      # one bad run, at the largest size
    huber = fit_power_law(C, L)
    lsq = fit_power_law(C, L, delta=1e9)
    assert rel(huber.alpha, 0.05) < 5e-3 and rel(huber.A, 2.3) < 5e-3
    assert rel(lsq.alpha, 0.05) > 5e-2 > 10 * rel(huber.alpha, 0.05)  # least squares follows the outlier


def test_compute_at_refuses_unreachable_loss():
    fit = PowerLawFit(A=400.0, alpha=0.15, E=1.7, n=9, irreducible=True)
    for loss in (1.7, 1.0):
        with pytest.raises(ValueError, match=r"^loss=.*irreducible"):
            fit.compute_at(loss)
    with pytest.raises(ValueError, match=r"^loss=.*alpha"):
        PowerLawFit(A=2.0, alpha=-0.01).compute_at(1.5)


# ------------------------------------------------------------------------------------------------ bootstrap
def test_bootstrap_interval_covers_true_alpha_fixed_seed():
    runs = synthetic_runs(2.3, 0.05, noise=0.01, seed=0)
    boot = bootstrap_fits(runs, n_boot=1000, seed=0)
    lo, hi = boot.interval("alpha")
    assert lo <= 0.05 <= hi and hi - lo < 0.015
    assert boot.alpha.shape == boot.A.shape == boot.E.shape == (1000,) and not boot.E.any()
    assert boot.n_sizes == 6 and boot.point.n == 18
    again = bootstrap_fits(runs, n_boot=1000, seed=0)                  # deterministic
    np.testing.assert_array_equal(again.alpha, boot.alpha)


def test_bootstrap_coverage_over_20_datasets():
    covered = 0
    for s in range(20):
        runs = synthetic_runs(2.3, 0.05, noise=0.01, seed=100 + s)
        lo, hi = bootstrap_fits(runs, n_boot=200, seed=s).interval("alpha")
        covered += lo <= 0.05 <= hi
    assert covered >= 17, covered


def test_one_run_per_size_still_gets_an_interval():
    # size-to-size scatter only (one seed per size): the stratified part has nothing to resample, the
    # residual component gives the interval; by="size" gives one too
    runs = synthetic_runs(2.3, 0.05, sizes_compute=np.geomspace(1e15, 1e19, 8), seeds=1, noise=0.0,
                          size_noise=0.01, seed=3)
    for by in ("seed", "residual", "size"):
        lo, hi = bootstrap_fits(runs, n_boot=400, by=by).interval("alpha")
        assert 0.002 < hi - lo < 0.03 and lo <= 0.05 <= hi, (by, lo, hi)


def test_stratified_counts_keep_every_size_with_its_run_count():
    groups = [np.array([0, 1, 2]), np.array([3]), np.array([4, 5])]
    W = sf._stratified_counts(groups, 500, 6, np.random.default_rng(0))
    for ix in groups:
        assert (W[:, ix].sum(1) == ix.size).all()
    assert (W[:, 3] == 1).all() and W[:, 0].std() > 0
    Ws = sf._size_counts(groups, 200, 6, 3, np.random.default_rng(0))  # need 3 distinct of 3: each once
    assert (Ws == 1).all()


# ------------------------------------------------------------------------------------------------ multiplier
def test_multiplier_recovers_a_known_compute_shift():
    # L_var(C) = L_base(1.16·C): A_var = A·1.16^−α, so M = 1.16 at every loss
    A, alpha = 5.0, 0.08
    base = synthetic_runs(A, alpha, noise=0.003, seed=1)
    var = synthetic_runs(A * 1.16 ** -alpha, alpha, noise=0.003, seed=2)
    m = compute_multiplier(base, var, n_boot=500)
    assert m.lo <= 1.16 <= m.hi and m.lo > 1.0 and abs(m.value - 1.16) < 0.03
    assert m.n_boot == 500 and m.n_valid == 500 and m.draws.shape == (500,)
    assert verdict(m, 1.16) == "reproduced"
    swapped = compute_multiplier(var, base, n_boot=200)
    assert swapped.hi < 1.0 and verdict(swapped, 1.16) == "opposite direction"


def test_kimi_linear_vs_mla_published_pair():
    # analytic: M(L) = (2.3092/L)^(1/0.0536) / (2.2879/L)^(1/0.0527); exact points at HP-2's five sizes
    base = synthetic_runs(*KL_MLA, sizes_compute=KL_COMPUTE, seeds=1, noise=0.0)
    var = synthetic_runs(*KL_KIMI_LINEAR, sizes_compute=KL_COMPUTE, seeds=1, noise=0.0)
    losses_b = [r["loss"] for r in base]
    losses_v = [r["loss"] for r in var]
    lo, hi = max(min(losses_b), min(losses_v)), min(max(losses_b), max(losses_v))
    m = compute_multiplier(base, var, n_boot=50)
    assert m.ref_loss == pytest.approx(math.sqrt(lo * hi), rel=1e-12)
    assert m.ref_loss == pytest.approx(2.1056, abs=1e-4)
    L = m.ref_loss
    analytic = (KL_MLA[0] / L) ** (1 / KL_MLA[1]) / (KL_KIMI_LINEAR[0] / L) ** (1 / KL_KIMI_LINEAR[1])
    assert rel(m.value, analytic) < 1e-6
    assert m.value == pytest.approx(1.1577, abs=1e-4)                  # KL's "1.16×", at C_MLA = 5.60 PFLOP/s-days
    assert m.lo == pytest.approx(m.value, rel=1e-6) and m.hi == pytest.approx(m.value, rel=1e-6)
    assert m.summary() == "1.16× [1.16, 1.16] at L*=2.11"
    # the two exponents differ, so the multiplier depends on L*: larger at the high-loss end
    at_top = compute_multiplier(base, var, ref_loss=hi, n_boot=10)
    assert at_top.value > m.value > compute_multiplier(base, var, ref_loss=lo, n_boot=10).value


def test_ref_loss_outside_the_overlap_is_refused():
    base = synthetic_runs(5.0, 0.08, noise=0.0, seeds=1)
    var = synthetic_runs(5.0 * 1.16 ** -0.08, 0.08, noise=0.0, seeds=1)
    lo, hi = sf.loss_overlap(base, var)
    for ref in (lo * 0.99, hi * 1.01, float("nan")):
        with pytest.raises(ValueError, match=r"^ref_loss="):
            compute_multiplier(base, var, ref_loss=ref, n_boot=10)
    assert compute_multiplier(base, var, ref_loss=hi, n_boot=10).ref_loss == hi
    far = synthetic_runs(0.5, 0.08, noise=0.0, seeds=1)                 # never reaches the base's losses
    with pytest.raises(ValueError, match=r"^ref_loss: .*do not overlap"):
        compute_multiplier(base, far, n_boot=10)


# ------------------------------------------------------------------------------------------------ verdict
def made(lo, hi, value=None):
    fit = PowerLawFit(A=2.0, alpha=0.05)
    return Multiplier(value=value if value is not None else math.sqrt(lo * hi), lo=lo, hi=hi, ref_loss=2.41,
                      n_boot=1000, base=fit, variant=fit)


@pytest.mark.parametrize("lo, hi, paper, label", [
    (1.05, 1.30, 1.16, "reproduced"),
    (1.16, 1.20, 1.16, "reproduced"),                                   # ends count as inside
    (1.30, 1.50, 1.16, "same direction"),
    (1.01, 1.10, 1.25, "same direction"),
    (0.80, 0.95, 1.16, "opposite direction"),
    (0.90, 1.30, 1.16, "not reproduced at this scale"),                 # contains the paper and 1.0
    (0.97, 1.05, 1.16, "not reproduced at this scale"),
    (0.70, 0.90, 0.80, "reproduced"),                                   # a paper value below 1
    (0.85, 0.95, 0.80, "same direction"),
    (1.10, 1.20, 0.80, "opposite direction"),
])
def test_verdict_labels(lo, hi, paper, label):
    assert verdict(made(lo, hi), paper) == label
    assert label in sf.VERDICTS


def test_summary_format():
    assert made(1.05, 1.30, value=1.16).summary() == "1.16× [1.05, 1.30] at L*=2.41"


# ------------------------------------------------------------------------------------------------ helpers
def test_mean_interval():
    assert mean_interval([2.5]) == (2.5, 2.5, 2.5)                      # one seed: a point, not an interval
    v = [2.40, 2.43, 2.41, 2.46, 2.38]
    mean, lo, hi = mean_interval(v)
    assert mean == pytest.approx(np.mean(v)) and min(v) <= lo < mean < hi <= max(v)
    assert mean_interval(v) == (mean, lo, hi)


def test_synthetic_runs_follow_the_law():
    runs = synthetic_runs(2.0, 0.1, E=0.5, sizes_compute=[1e3, 1e4], seeds=2, noise=0.0)
    assert [r["size"] for r in runs] == ["s0", "s0", "s1", "s1"] and [r["seed"] for r in runs] == [0, 1, 0, 1]
    assert runs[2]["loss"] == pytest.approx(0.5 + 2.0 * 1e4 ** -0.1, rel=1e-12)
    noisy = synthetic_runs(2.0, 0.1, noise=0.01, seeds=200, sizes_compute=[1e3])
    logs = np.log([r["loss"] for r in noisy]) - math.log(2.0 * 1e3 ** -0.1)
    assert abs(logs.mean()) < 0.003 and logs.std() == pytest.approx(0.01, rel=0.15)


# ------------------------------------------------------------------------------------------------ refusals
GOOD_C = [1e15, 1e16, 1e17, 1e18]
GOOD_L = [3.0, 2.8, 2.6, 2.5]
GOOD_RUNS = synthetic_runs(2.3, 0.05, noise=0.01, seeds=1)


@pytest.mark.parametrize("call, name", [
    (lambda: fit_power_law(GOOD_C[:2], GOOD_L[:2]), "C"),
    (lambda: fit_power_law(GOOD_C[:3], GOOD_L[:3], irreducible=True), "C"),
    (lambda: fit_power_law([1e15, 1e15, 1e15], [3.0, 2.9, 3.1]), "C"),
    (lambda: fit_power_law([1e15, -1e16, 1e17, 1e18], GOOD_L), "C"),
    (lambda: fit_power_law(GOOD_C, [3.0, 0.0, 2.6, 2.5]), "L"),
    (lambda: fit_power_law(GOOD_C, [3.0, float("nan"), 2.6, 2.5]), "L"),
    (lambda: fit_power_law([1e15, float("nan"), 1e17, 1e18], GOOD_L), "C"),
    (lambda: fit_power_law(GOOD_C, GOOD_L[:3]), "L"),
    (lambda: fit_power_law(GOOD_C, GOOD_L, delta=0.0), "delta"),
    (lambda: fit_power_law(GOOD_C, GOOD_L, irreducible="yes"), "irreducible"),
    (lambda: PowerLawFit(A=2.0, alpha=0.05).predict([1.0, 0.0]), "C"),
    (lambda: bootstrap_fits(GOOD_RUNS, by="sizes"), "by"),
    (lambda: bootstrap_fits(GOOD_RUNS, n_boot=0), "n_boot"),
    (lambda: bootstrap_fits([{"compute": 1e15, "loss": 3.0}] * 4), "runs"),
    (lambda: bootstrap_fits([]), "runs"),
    (lambda: bootstrap_fits(GOOD_RUNS[:3], irreducible=True), "runs"),
    (lambda: compute_multiplier(GOOD_RUNS, GOOD_RUNS[:2]), "variant_runs"),
    (lambda: verdict(made(1.05, 1.3), 0.0), "paper_value"),
    (lambda: verdict(made(1.05, 1.3), 1.0), "paper_value"),
    (lambda: verdict(made(1.05, 1.3), float("nan")), "paper_value"),
    (lambda: mean_interval([]), "values"),
    (lambda: mean_interval([2.4, float("inf")]), "values"),
    (lambda: synthetic_runs(2.3, 0.05, noise=-0.1), "noise"),
    (lambda: synthetic_runs(2.3, 0.05, sizes_compute=[1e15, 0.0]), "sizes_compute"),
])
def test_bad_inputs_refused_with_one_line_naming_the_argument(call, name):
    with pytest.raises(ValueError) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg and msg.split(":")[0].split("=")[0].split("[")[0] == name, msg
