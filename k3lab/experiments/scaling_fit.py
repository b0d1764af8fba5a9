"""Scaling-law fits with bootstrap intervals, compute multipliers and the verdict rule (issue 35): the pure-math
half of the scaling harness. No model, no trainer, no file: runs come in as plain dicts
``{"compute": FLOPs, "loss": L, "size": label, "seed": int}``.

* :func:`fit_power_law` — ``L(C) = A·C^−α`` (or ``E + A·C^−α``) fitted in log space under a Huber loss, as
  Chinchilla's approach 3 (Hoffmann et al. 2022, §3.3 and App. D.2: δ = 10⁻³ on log-residuals);
* :func:`bootstrap_fits` — the same fit over resampled runs (stratified by size, plus a size-level residual
  component; see its docstring for exactly what is resampled);
* :func:`compute_multiplier` — ``M = C_base(L*) / C_variant(L*)`` at a reference loss reached by both, with a
  95% percentile interval (KL §5.3 reports 1.16× for Kimi Linear over MLA; AR §5.1 1.25× for Block AttnRes);
* :func:`verdict` — the rule written before the runs, from that interval and the paper's value;
* :func:`mean_interval` — a mean over seeds with a bootstrap interval (HYB-2's per-size validation losses);
* :func:`synthetic_runs` — runs drawn from a known law, for the tests and the notebook's CPU demo.

Units: ``C`` in whatever unit the caller uses (FLOPs, PFLOP/s-days = 8.64·10¹⁹ FLOPs); ``L`` and ``E`` in
nats per token; ``A`` depends on the compute unit (``A·C^−α`` is a loss), ``α`` does not. The solver is numpy float64, deterministic
(no random starts), and batched: every bootstrap draw is one row of one Levenberg–Marquardt iteration.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["HUBER_DELTA", "VERDICTS", "Bootstrap", "Multiplier", "PowerLawFit", "bootstrap_fits",
           "compute_multiplier", "fit_power_law", "loss_overlap", "mean_interval", "synthetic_runs", "verdict"]

HUBER_DELTA = 1e-3                  # Chinchilla's δ on log-residuals
LEVEL = 95.0                        # every interval here is a 95% percentile interval (2.5, 97.5)
BOOTSTRAP_BY = ("seed", "residual", "size")
VERDICTS = ("reproduced", "same direction", "opposite direction", "not reproduced at this scale")
RUN_KEYS = ("compute", "loss", "size", "seed")
PFLOPS_DAY = 1e15 * 86400           # FLOPs in one PFLOP/s-day (KL's and AR's compute unit)
# E starting points of the irreducible fit, as fractions of the smallest loss (the fit is not convex in log E)
E_START_FRACTIONS = (1e-3, 0.3, 0.6, 0.8, 0.9, 0.97)
_MAX_ITER = 400


def _one_line(x) -> str:
    s = repr(x)
    return s if len(s) <= 60 else s[:57] + "..."


# --------------------------------------------------------------------------------------------- the solver
def _huber(r: np.ndarray, delta: float) -> np.ndarray:
    """``ρ_δ(r) = r²/2`` for ``|r| ≤ δ``, ``δ·(|r| − δ/2)`` beyond (elementwise)."""
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


def _model(theta: np.ndarray, u: np.ndarray, irreducible: bool):
    """log L̂ and its Jacobian. theta ``[M, P]`` = (a, α[, e]) with ``a = log A − α·x0`` (u = log C − x0
    centres the design, so that the (a, α) columns are not near-collinear); u ``[N]`` → f ``[M, N]``,
    J ``[M, N, P]``. Irreducible: ``f = logaddexp(e, a − α·u)``."""
    p = theta[:, :1] - theta[:, 1:2] * u                                   # [M, N]  log of the power term
    if not irreducible:
        J = np.stack([np.ones_like(p), -np.broadcast_to(u, p.shape)], axis=-1)
        return p, J
    e = theta[:, 2:3]
    f = np.logaddexp(e, p)
    s = np.exp(np.clip(p - f, -700.0, 0.0))                                # share of the power term in L̂
    J = np.stack([s, -u * s, 1.0 - s], axis=-1)
    return f, J


def _weighted_line(u: np.ndarray, Y: np.ndarray, W: np.ndarray) -> np.ndarray:
    """Weighted least squares of ``Y ≈ a − α·u`` per row: ``[M, 2]`` (a, α)."""
    sw = W.sum(1)
    mu = (W * u).sum(1) / sw
    my = (W * Y).sum(1) / sw
    cov = (W * (u - mu[:, None]) * (Y - my[:, None])).sum(1)
    var = (W * (u - mu[:, None]) ** 2).sum(1)
    slope = cov / np.maximum(var, 1e-300)
    return np.stack([my - slope * mu, -slope], axis=1)


def _solve(u: np.ndarray, Y: np.ndarray, W: np.ndarray, irreducible: bool, delta: float):
    """Minimise ``F(θ) = Σ_i W_i·ρ_δ(Y_i − f_i(θ))`` row by row: u ``[N]``, Y ``[B, N]`` (log L), W ``[B, N]``
    (bootstrap counts; 1 for a plain fit). Returns (θ ``[B, P]``, F ``[B]``).

    Levenberg–Marquardt on the iteratively reweighted normal equations: with ``ω = W·min(1, δ/|r|)``
    (= ψ(r)/r) the step solves ``(JᵀΩJ + λ·diag(JᵀΩJ))·Δ = JᵀΩr``; a step is kept only if F falls, so F
    never rises. Without E the problem is convex (Huber of a linear model), one start from least squares
    suffices; with E, one start per ``E_START_FRACTIONS`` (E₀ = f·min L, (a, α) from least squares of
    ``log(L − E₀)``) and the lowest F wins (ties: the first).
    """
    B, N = Y.shape
    if irreducible:
        masked = np.where(W > 0, Y, np.inf)
        ymin = masked.min(1)                                                # [B]  log of the smallest loss
        starts = []
        for frac in E_START_FRACTIONS:
            e0 = ymin + math.log(frac)
            Z = np.log(np.maximum(np.exp(Y) - np.exp(e0)[:, None], 1e-12 * np.exp(ymin)[:, None]))
            starts.append(np.concatenate([_weighted_line(u, Z, W), e0[:, None]], axis=1))
        S = len(starts)
        theta = np.concatenate(starts, axis=0)                             # [S·B, 3], start-major
        Y, W = np.tile(Y, (S, 1)), np.tile(W, (S, 1))
    else:
        S = 1
        theta = _weighted_line(u, Y, W)
    M, P = theta.shape
    f, J = _model(theta, u, irreducible)
    r = Y - f
    F = (W * _huber(r, delta)).sum(1)
    lam = np.full(M, 1e-4)
    active = np.ones(M, bool)
    eye = np.eye(P)
    for _ in range(_MAX_ITER):
        if not active.any():
            break
        idx = np.flatnonzero(active)
        ra, Ja, Wa = r[idx], J[idx], W[idx]
        omega = Wa * (delta / np.maximum(np.abs(ra), delta))                   # ψ(r)/r = min(1, δ/|r|)
        JO = Ja * omega[..., None]
        H = np.einsum("mnp,mnq->mpq", JO, Ja)                              # [m, P, P]
        g = np.einsum("mnp,mn->mp", JO, ra)                                # [m, P]
        d = np.einsum("mpp->mp", H)
        damp = lam[idx, None] * d + 1e-12 * d.max(1, keepdims=True) + 1e-300
        step = np.linalg.solve(H + damp[:, :, None] * eye, g[..., None])[..., 0]
        new = theta[idx] + step
        f_new, J_new = _model(new, u, irreducible)
        r_new = Y[idx] - f_new
        F_new = (Wa * _huber(r_new, delta)).sum(1)
        ok = np.isfinite(F_new) & (F_new <= F[idx])
        acc = idx[ok]
        theta[acc], r[acc], J[acc], F[acc] = new[ok], r_new[ok], J_new[ok], F_new[ok]
        lam[acc] = np.maximum(lam[acc] / 3.0, 1e-12)
        lam[idx[~ok]] *= 4.0
        small = np.abs(step).max(1) <= 1e-11 * (1.0 + np.abs(theta[idx]).max(1))
        active[idx[(ok & small) | (lam[idx] > 1e12)]] = False
    if S > 1:
        F_s = F.reshape(S, B)
        best = np.argmin(np.where(np.isfinite(F_s), F_s, np.inf), axis=0)   # first of equal minima
        theta = theta.reshape(S, B, P)[best, np.arange(B)]
        F = F_s[best, np.arange(B)]
    return theta, F


def _unpack(theta: np.ndarray, x0: float, irreducible: bool):
    """(a, α[, e]) → (A, α, E) arrays; ``a = log A − α·x0``, so ``A = exp(a + α·x0)``."""
    alpha = theta[:, 1]
    A = np.exp(theta[:, 0] + alpha * x0)
    E = np.exp(theta[:, 2]) if irreducible else np.zeros_like(alpha)
    return A, alpha, E


# --------------------------------------------------------------------------------------------- the fit
def _log_compute_at(A, alpha, E, loss):
    """``log C(L) = (log A − log(L − E))/α`` elementwise; +inf where the law never reaches L
    (L ≤ E or α ≤ 0)."""
    A, alpha, E = np.asarray(A, float), np.asarray(alpha, float), np.asarray(E, float)
    gap = loss - E
    ok = (gap > 0) & (alpha > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (np.log(A) - np.log(np.where(ok, gap, 1.0))) / np.where(ok, alpha, 1.0)
    return np.where(ok, out, np.inf)


@dataclass(frozen=True)
class PowerLawFit:
    """A fitted ``L(C) = E + A·C^−α`` (``E = 0.0`` when not fitted). ``n``: points fitted; ``huber_loss``:
    the minimised objective ``Σ_i ρ_δ(log L_i − log L̂_i)`` (a sum over points, as Chinchilla)."""

    A: float
    alpha: float
    E: float = 0.0
    n: int = 0
    huber_loss: float = float("nan")
    irreducible: bool = False
    delta: float = HUBER_DELTA

    def predict(self, C):
        """``L̂(C) = E + A·C^−α``; C scalar or array (positive), same shape back (float for a scalar)."""
        c = np.asarray(C, dtype=float)
        if not (np.all(np.isfinite(c)) and np.all(c > 0)):
            raise ValueError(f"C={_one_line(C)}: must be positive and finite")
        out = self.E + self.A * np.exp(-self.alpha * np.log(c))
        return float(out) if out.ndim == 0 else out

    def compute_at(self, loss: float) -> float:
        """The inverse: ``C(L) = (A / (L − E))^(1/α)``, the compute at which the law reaches ``loss``."""
        if not (isinstance(loss, (int, float, np.floating)) and math.isfinite(loss)):
            raise ValueError(f"loss={_one_line(loss)}: must be a finite number")
        if loss <= self.E:
            raise ValueError(f"loss={loss!r}: must exceed the irreducible loss E={self.E:.6g}; "
                             f"the law never reaches it")
        if self.alpha <= 0:
            raise ValueError(f"loss={loss!r}: unreachable, the fit has alpha={self.alpha:.6g} <= 0 "
                             f"(loss does not fall)")
        return float(np.exp(_log_compute_at(self.A, self.alpha, self.E, float(loss))))

    def __str__(self) -> str:
        head = f"{self.E:.4g} + " if self.irreducible else ""
        return f"L = {head}{self.A:.4g}·C^−{self.alpha:.4g} (n={self.n}, huber={self.huber_loss:.3g})"


def _check_points(C, L, irreducible: bool) -> tuple[np.ndarray, np.ndarray]:
    c = np.asarray(C, dtype=float)
    lo = np.asarray(L, dtype=float)
    if c.ndim != 1 or lo.ndim != 1:
        raise ValueError(f"C, L: must be 1-D sequences, got shapes {c.shape} and {lo.shape}")
    if c.shape != lo.shape:
        raise ValueError(f"L: length {lo.size} does not match C's length {c.size}")
    for name, v in (("C", c), ("L", lo)):
        if np.isnan(v).any():
            raise ValueError(f"{name}: contains NaN at index {int(np.flatnonzero(np.isnan(v))[0])}")
        if not (np.isfinite(v).all() and (v > 0).all()):
            i = int(np.flatnonzero(~(np.isfinite(v) & (v > 0)))[0])
            raise ValueError(f"{name}: must be positive and finite, got {v[i]!r} at index {i}")
    need = 4 if irreducible else 3
    if c.size < need:
        raise ValueError(f"C: needs at least {need} points {'with' if irreducible else 'without'} an irreducible "
                         f"term, got {c.size}")
    if np.unique(c).size < need - 1:
        raise ValueError(f"C: needs at least {need - 1} distinct compute values, got {np.unique(c).size}")
    return c, lo


def _check_delta(delta) -> float:
    if not (isinstance(delta, (int, float)) and math.isfinite(delta) and delta > 0):
        raise ValueError(f"delta={_one_line(delta)}: must be a positive finite number")
    return float(delta)


def fit_power_law(C, L, irreducible: bool = False, delta: float = HUBER_DELTA) -> PowerLawFit:
    """Fit ``L(C) = A·C^−α`` (``irreducible=True``: ``L(C) = E + A·C^−α``) in log space:

        minimise  Σ_i ρ_δ( log L_i − log L̂(C_i) ),
        log L̂ = log A − α·log C      (irreducible: logaddexp(log E, log A − α·log C))

    with ρ_δ the Huber loss (quadratic within ``δ`` of zero, linear beyond), as Chinchilla's approach 3
    (δ = 10⁻³: with log-residuals of ~1% the fit is close to least absolute deviations, so one bad run moves
    it little). ``delta=1e9`` makes it ordinary least squares in log space. Parameters are (log A, α[, log E]),
    so A, E > 0; α is not constrained. Solver: :func:`_solve` (deterministic, several E starts).

    C ``[n]`` (compute, any positive unit), L ``[n]`` (loss) → :class:`PowerLawFit`. Refuses fewer than 3
    points (4 with ``irreducible``), fewer than 2 (3) distinct C, non-positive, NaN or infinite values, and
    mismatched lengths.
    """
    if not isinstance(irreducible, (bool, np.bool_)):
        raise ValueError(f"irreducible={_one_line(irreducible)}: must be True or False")
    delta = _check_delta(delta)
    c, lo = _check_points(C, L, bool(irreducible))
    x = np.log(c)
    x0 = float(x.mean())
    theta, F = _solve(x - x0, np.log(lo)[None], np.ones((1, c.size)), bool(irreducible), delta)
    A, alpha, E = _unpack(theta, x0, bool(irreducible))
    return PowerLawFit(A=float(A[0]), alpha=float(alpha[0]), E=float(E[0]), n=int(c.size), huber_loss=float(F[0]),
                       irreducible=bool(irreducible), delta=delta)


# --------------------------------------------------------------------------------------------- bootstrap
@dataclass(frozen=True, eq=False)
class Bootstrap:
    """The full-data fit ``point`` and the fitted parameters over ``n_boot`` resampled draws (arrays
    ``[n_boot]``; ``E`` all zeros without an irreducible term). ``by``: what was resampled
    (:func:`bootstrap_fits`); ``n_sizes``: distinct size labels."""

    point: PowerLawFit
    A: np.ndarray = field(repr=False)
    alpha: np.ndarray = field(repr=False)
    E: np.ndarray = field(repr=False)
    huber_loss: np.ndarray = field(repr=False)
    n_boot: int = 0
    by: str = "seed"
    seed: int = 0
    n_sizes: int = 0

    def interval(self, name: str = "alpha") -> tuple[float, float]:
        """95% percentile interval (2.5th, 97.5th) of ``A``, ``alpha`` or ``E`` over the draws."""
        if name not in ("A", "alpha", "E"):
            raise ValueError(f"name={name!r}: allowed values are ('A', 'alpha', 'E')")
        lo, hi = np.percentile(getattr(self, name), [(100 - LEVEL) / 2, (100 + LEVEL) / 2])
        return float(lo), float(hi)

    def log_compute_at(self, loss: float) -> np.ndarray:
        """``log C(loss)`` per draw ``[n_boot]``; +inf where a draw never reaches ``loss`` (L ≤ E or α ≤ 0)."""
        return _log_compute_at(self.A, self.alpha, self.E, float(loss))


def _check_runs(runs, name: str = "runs"):
    """runs → (C ``[n]``, L ``[n]``, groups: list of index arrays, one per size label in first-seen order)."""
    if isinstance(runs, (str, bytes, dict)) or not hasattr(runs, "__len__") or len(runs) == 0:
        raise ValueError(f"{name}: must be a non-empty list of dicts with keys {RUN_KEYS}")
    C, L, labels = [], [], []
    for i, run in enumerate(runs):
        if not isinstance(run, dict) or any(k not in run for k in RUN_KEYS):
            missing = [k for k in RUN_KEYS if not isinstance(run, dict) or k not in run]
            raise ValueError(f"{name}[{i}]: missing keys {missing}; each run needs {RUN_KEYS}")
        try:
            C.append(float(run["compute"]))
            L.append(float(run["loss"]))
        except (TypeError, ValueError):
            raise ValueError(f"{name}[{i}]: compute and loss must be numbers, got {_one_line(run)}") from None
        labels.append(run["size"])
    order: dict = {}
    for i, lab in enumerate(labels):
        order.setdefault(lab, []).append(i)
    groups = [np.asarray(ix) for ix in order.values()]
    return np.asarray(C), np.asarray(L), groups


def _stratified_counts(groups, n_boot: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap counts ``[n_boot, n]``: within each size, its runs drawn with replacement, as many as it has
    (a size with one run keeps that run), so every draw holds every size with its own number of runs."""
    W = np.zeros((n_boot, n))
    rows = np.arange(n_boot)[:, None]
    for ix in groups:
        picks = ix[rng.integers(0, ix.size, size=(n_boot, ix.size))]
        np.add.at(W, (np.broadcast_to(rows, picks.shape), picks), 1.0)
    return W


def _size_counts(groups, n_boot: int, n: int, need: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap counts ``[n_boot, n]`` from sizes drawn with replacement (all runs of a drawn size, once per
    draw of it); a draw with fewer than ``need`` distinct sizes cannot be fitted and is drawn again."""
    K = len(groups)
    kept = []
    for _ in range(200):
        ks = rng.integers(0, K, size=(n_boot, K))
        distinct = np.array([np.unique(row).size for row in ks])
        kept.extend(ks[distinct >= need])
        if len(kept) >= n_boot:
            break
    else:
        raise ValueError(f"by='size': {K} sizes rarely give {need} distinct ones in a draw; use by='seed'")
    ks = np.asarray(kept[:n_boot])
    W = np.zeros((n_boot, n))
    for k, ix in enumerate(groups):
        W[:, ix] += (ks == k).sum(1, keepdims=True)
    return W


def _bootstrap(runs, irreducible, n_boot, rng, by, delta, name="runs", seed=0) -> Bootstrap:
    if by not in BOOTSTRAP_BY:
        raise ValueError(f"by={by!r}: allowed values are {BOOTSTRAP_BY}")
    if not (isinstance(n_boot, (int, np.integer)) and not isinstance(n_boot, bool) and n_boot >= 1):
        raise ValueError(f"n_boot={_one_line(n_boot)}: must be an int >= 1")
    if not isinstance(irreducible, (bool, np.bool_)):
        raise ValueError(f"irreducible={_one_line(irreducible)}: must be True or False")
    delta = _check_delta(delta)
    C, L, groups = _check_runs(runs, name)
    try:
        _check_points(C, L, bool(irreducible))
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    P = 3 if irreducible else 2
    K = len(groups)
    if K < P + 1:
        raise ValueError(f"{name}: needs at least {P + 1} distinct sizes {'with' if irreducible else 'without'} an "
                         f"irreducible term, got {K}")
    point = fit_power_law(C, L, irreducible=bool(irreducible), delta=delta)
    n = C.size
    x = np.log(C)
    x0 = float(x.mean())
    y = np.log(L)
    if by == "size":
        W = _size_counts(groups, n_boot, n, P + 1, rng)
        Y = np.broadcast_to(y, (n_boot, n)).copy()
    else:
        W = _stratified_counts(groups, n_boot, n, rng) if by == "seed" else np.ones((n_boot, n))
        # size-level residual component: size k's mean log-residual r̄_k from the point fit is swapped for
        # another size's (drawn with replacement, centred, inflated by √(K/(K−P)) for the P fitted parameters)
        resid = y - np.log(point.predict(C))
        rbar = np.array([resid[ix].mean() for ix in groups])               # [K]
        pool = (rbar - rbar.mean()) * math.sqrt(K / (K - P))
        drawn = pool[rng.integers(0, K, size=(n_boot, K))]                 # [n_boot, K]
        Y = np.broadcast_to(y, (n_boot, n)).copy()
        for k, ix in enumerate(groups):
            Y[:, ix] += (drawn[:, k] - rbar[k])[:, None]
    theta, F = _solve(x - x0, Y, W, bool(irreducible), delta)
    A, alpha, E = _unpack(theta, x0, bool(irreducible))
    return Bootstrap(point=point, A=A, alpha=alpha, E=E, huber_loss=F, n_boot=int(n_boot), by=by, seed=seed,
                     n_sizes=K)


def bootstrap_fits(runs, irreducible: bool = False, n_boot: int = 1000, seed: int = 0, by: str = "seed",
                   delta: float = HUBER_DELTA) -> Bootstrap:
    """Fit :func:`fit_power_law` to all ``runs`` (the point fit) and to ``n_boot`` resampled versions of them.

    ``runs``: dicts ``{"compute", "loss", "size", "seed"}``; runs with equal ``size`` labels form one size.
    Every draw refits the same ``n`` log-compute points; what changes is which runs count (integer weights)
    and, with the residual component, their log-losses. ``by`` chooses what is resampled:

    * ``"seed"`` (default) — two components per draw. (1) Stratified: within each size its runs are drawn
      with replacement, as many as it has, so every size stays represented with its own run count (a size
      with one run keeps that run). This carries seed-to-seed noise. (2) Size-level residuals: with
      ``r̄_k`` the mean log-residual of size k under the point fit, size k's log-losses are shifted by
      ``c·(r̄_k' − mean r̄) − r̄_k``, with k' drawn uniformly from the K sizes and ``c = √(K/(K−P))``
      (P = 2 or 3 fitted parameters; residuals of a fit are smaller than the errors). This carries
      size-to-size scatter — shape irregularities, a learning rate better tuned at one size — which seeds
      alone cannot show. With one run per size, (1) does nothing and the interval comes from (2) alone;
      with several, seed noise enters both (through r̄), so the interval errs wide, by at most ≈ √2 in
      width when the law is exact.
    * ``"residual"`` — component (2) alone: the classic residual bootstrap at the size level (fixed design,
      within-size deviations kept). Right on average, but with few sizes its tails are thin.
    * ``"size"`` — sizes drawn with replacement (all runs of a drawn size), the pairs bootstrap over sizes;
      a draw with fewer than P + 1 distinct sizes cannot be fitted and is drawn again. Crude with < 6 sizes.

    Measured coverage of the true α by the 95% interval (200 synthetic data sets from
    :func:`synthetic_runs`: 6 sizes over 1024×, 1% log-normal noise per run, ``n_boot=200``):

    | data                                | seed  | residual | size  |
    |-------------------------------------|-------|----------|-------|
    | 3 seeds per size, seed noise only   | 98%   | 86.5%    | 91.5% |
    | 3 seeds per size + 1% size scatter  | 94.5% | 89.5%    | 91.5% |
    | 1 seed per size                     | 89.5% | 89.5%    | 90.5% |
    | 1 seed per size + 1% size scatter   | 90.5% | 90.5%    | 92%   |

    With one seed per size the 6 − 2 = 4 residual degrees of freedom are few: a percentile interval has
    normal tails where Student's t₄ has wider ones; add sizes or seeds for a tighter claim. Needs at least
    P + 1 distinct sizes (3; 4 with ``irreducible``). Deterministic in ``seed``.
    """
    return _bootstrap(runs, irreducible, n_boot, np.random.default_rng(seed), by, delta, "runs", seed)


# --------------------------------------------------------------------------------------------- multiplier
@dataclass(frozen=True, eq=False)
class Multiplier:
    """``M = C_base(L*) / C_variant(L*)`` (> 1: the variant reaches ``ref_loss`` with less compute), from the
    full-data fits ``base`` and ``variant``, with its 95% percentile interval ``[lo, hi]`` over ``n_boot``
    paired draws (``draws [n_boot]``; ``n_valid`` of them finite — a draw whose law never reaches L* has none)."""

    value: float
    lo: float
    hi: float
    ref_loss: float
    n_boot: int
    base: PowerLawFit
    variant: PowerLawFit
    n_valid: int = 0
    draws: np.ndarray = field(default=None, repr=False)

    def summary(self) -> str:
        """E.g. ``"1.16× [1.05, 1.30] at L*=2.41"``."""
        def num(x: float) -> str:  # an unbounded upper end (flat fits) reads as a magnitude, not 15 digits
            return f"{x:.2f}" if abs(x) < 1e3 else f"{x:.1e}"

        return f"{num(self.value)}× [{num(self.lo)}, {num(self.hi)}] at L*={self.ref_loss:.3g}"


def loss_overlap(base_runs, variant_runs) -> tuple[float, float]:
    """``[max of the two minima, min of the two maxima]`` of the losses the two sets of runs reached."""
    _, lb, _ = _check_runs(base_runs, "base_runs")
    _, lv, _ = _check_runs(variant_runs, "variant_runs")
    return float(max(lb.min(), lv.min())), float(min(lb.max(), lv.max()))


def compute_multiplier(base_runs, variant_runs, ref_loss: float | None = None, n_boot: int = 1000, seed: int = 0,
                       irreducible: bool = False, by: str = "seed", delta: float = HUBER_DELTA) -> Multiplier:
    """The compute multiplier of ``variant_runs`` over ``base_runs`` at the reference loss L*:

        M = C_base(L*) / C_variant(L*),   C(L) = (A / (L − E))^(1/α)

    M > 1: the variant needs M× less compute to reach L* (KL §5.3's "1.16× more compute-efficient").
    L* defaults to the midpoint in log space, ``√(lo·hi)``, of the loss range both reached,
    ``[lo, hi] = [max(min L_base, min L_var), min(max L_base, max L_var)]``; a given ``ref_loss`` must lie in
    it — the multiplier interpolates between runs, never extrapolates. Each variant is bootstrapped on its own
    (:func:`bootstrap_fits` with ``by``; independent streams from ``seed``) and draw b of one is paired with
    draw b of the other; the point value is from the full-data fits, the interval the 2.5th and 97.5th
    percentiles of the finite draws.
    """
    lo, hi = loss_overlap(base_runs, variant_runs)
    if not lo < hi:
        raise ValueError(f"ref_loss: the loss ranges reached do not overlap (max of minima {lo:.6g} >= min of "
                         f"maxima {hi:.6g}); a multiplier there would be an extrapolation")
    if ref_loss is None:
        ref = math.sqrt(lo * hi)
    else:
        if not (isinstance(ref_loss, (int, float, np.floating)) and math.isfinite(ref_loss)):
            raise ValueError(f"ref_loss={_one_line(ref_loss)}: must be a finite number or None")
        if not lo <= ref_loss <= hi:
            raise ValueError(f"ref_loss={ref_loss!r}: outside [{lo:.6g}, {hi:.6g}], the loss range both variants "
                             f"reached; the multiplier is interpolated, never extrapolated")
        ref = float(ref_loss)
    b = _bootstrap(base_runs, irreducible, n_boot, np.random.default_rng([seed, 0]), by, delta, "base_runs", seed)
    v = _bootstrap(variant_runs, irreducible, n_boot, np.random.default_rng([seed, 1]), by, delta, "variant_runs",
                   seed)
    try:
        value = math.exp(math.log(b.point.compute_at(ref)) - math.log(v.point.compute_at(ref)))
    except ValueError as err:
        raise ValueError(f"ref_loss={ref!r}: a full-data fit never reaches it ({err})") from None
    with np.errstate(invalid="ignore"):
        draws = np.exp(b.log_compute_at(ref) - v.log_compute_at(ref))
    finite = draws[np.isfinite(draws) & (draws > 0)]
    if finite.size == 0:
        raise ValueError(f"ref_loss={ref!r}: no bootstrap draw reaches it in both variants")
    q_lo, q_hi = np.percentile(finite, [(100 - LEVEL) / 2, (100 + LEVEL) / 2])
    return Multiplier(value=value, lo=float(q_lo), hi=float(q_hi), ref_loss=ref, n_boot=int(n_boot), base=b.point,
                      variant=v.point, n_valid=int(finite.size), draws=draws)


def verdict(multiplier: Multiplier, paper_value: float) -> str:
    """The rule written before the runs, from our 95% interval ``[lo, hi]`` and the paper's multiplier:

    * ``"reproduced"`` — ``lo ≤ paper_value ≤ hi`` and the interval excludes 1.0;
    * ``"same direction"`` — the interval excludes 1.0 on the paper's side (paper > 1: lo > 1; paper < 1:
      hi < 1) but does not contain the paper's value;
    * ``"opposite direction"`` — it excludes 1.0 on the other side;
    * ``"not reproduced at this scale"`` — otherwise (the interval contains 1.0).
    """
    if not (isinstance(paper_value, (int, float, np.floating)) and math.isfinite(paper_value) and paper_value > 0
            and paper_value != 1):
        raise ValueError(f"paper_value={_one_line(paper_value)}: must be a positive finite multiplier other than 1.0")
    lo, hi = getattr(multiplier, "lo", None), getattr(multiplier, "hi", None)
    if not (isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and math.isfinite(lo)
            and math.isfinite(hi) and 0 < lo <= hi):
        raise ValueError(f"multiplier: needs a finite interval 0 < lo <= hi, got lo={lo!r}, hi={hi!r}")
    above, below = lo > 1.0, hi < 1.0
    paper_side, other_side = (above, below) if paper_value > 1 else (below, above)
    if paper_side:
        return VERDICTS[0] if lo <= paper_value <= hi else VERDICTS[1]
    if other_side:
        return VERDICTS[2]
    return VERDICTS[3]


# --------------------------------------------------------------------------------------------- helpers
def mean_interval(values, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """``(mean, lo, hi)``: the mean of ``values`` (e.g. one size's validation loss over seeds) and the 95%
    percentile interval of the mean over ``n_boot`` resamples with replacement. With one value the result is
    ``(v, v, v)``: an interval from one seed is a point, not a claim of no spread. With few values the
    bootstrap interval is narrower than a t interval (3 seeds: 27 distinct resamples at most)."""
    v = np.asarray(values, dtype=float)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"values={_one_line(values)}: must be a non-empty 1-D sequence of numbers")
    if not np.isfinite(v).all():
        raise ValueError(f"values: must be finite, got {v[~np.isfinite(v)][0]!r}")
    if not (isinstance(n_boot, (int, np.integer)) and not isinstance(n_boot, bool) and n_boot >= 1):
        raise ValueError(f"n_boot={_one_line(n_boot)}: must be an int >= 1")
    mean = float(v.mean())
    if v.size == 1:
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(n_boot, v.size))].mean(1)
    lo, hi = np.percentile(means, [(100 - LEVEL) / 2, (100 + LEVEL) / 2])
    return mean, float(lo), float(hi)


def synthetic_runs(A: float, alpha: float, E: float = 0.0,
                   sizes_compute=(1e15, 4e15, 1.6e16, 6.4e16, 2.56e17, 1.024e18), seeds: int = 3,
                   noise: float = 0.01, seed: int = 0, size_noise: float = 0.0) -> list[dict]:
    """Runs from a known law: ``loss = (E + A·C^−α)·exp(size_noise·η_k + noise·ε_kj)``, with
    ``η, ε ~ N(0, 1)`` i.i.d. (``numpy.random.default_rng(seed)``): multiplicative log-normal noise per run
    (``noise``, the seed-to-seed spread in log-loss) and per size (``size_noise``, shared by a size's seeds).
    ``sizes_compute``: compute per size (the default spans 1024× in six 4× steps); ``seeds`` runs per size,
    labelled ``"s0", "s1", …`` by size and ``0 … seeds−1`` by seed. Returns
    ``[{"compute", "loss", "size", "seed"}]``.
    """
    for name, val in (("A", A), ("alpha", alpha), ("E", E), ("noise", noise), ("size_noise", size_noise)):
        if not (isinstance(val, (int, float)) and math.isfinite(val)):
            raise ValueError(f"{name}={_one_line(val)}: must be a finite number")
    if A <= 0:
        raise ValueError(f"A={A!r}: must be > 0")
    if E < 0 or noise < 0 or size_noise < 0:
        bad = "E" if E < 0 else "noise" if noise < 0 else "size_noise"
        raise ValueError(f"{bad}={dict(E=E, noise=noise, size_noise=size_noise)[bad]!r}: must be >= 0")
    if not (isinstance(seeds, int) and not isinstance(seeds, bool) and seeds >= 1):
        raise ValueError(f"seeds={_one_line(seeds)}: must be an int >= 1")
    c = np.asarray(sizes_compute, dtype=float)
    if c.ndim != 1 or c.size == 0 or not (np.isfinite(c).all() and (c > 0).all()):
        raise ValueError(f"sizes_compute={_one_line(sizes_compute)}: must be a non-empty sequence of positive numbers")
    rng = np.random.default_rng(seed)
    eta = rng.standard_normal(c.size)
    eps = rng.standard_normal((c.size, seeds))
    runs = []
    for k, ck in enumerate(c):
        law = E + A * ck ** (-alpha)
        for j in range(seeds):
            runs.append({"compute": float(ck), "loss": float(law * math.exp(size_noise * eta[k] + noise * eps[k, j])),
                         "size": f"s{k}", "seed": j})
    return runs
