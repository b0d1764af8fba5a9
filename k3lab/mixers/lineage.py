"""The linear-attention lineage as recurrences: linear attention → RetNet → Mamba2 → DeltaNet →
Gated DeltaNet → KDA (docs/k3_reference.md §2.2).

Every mixer keeps a matrix state ``S ∈ R^{K×V}`` per head and reads it with the query,
``o_t = S_tᵀ q_t``. The family differs only in how ``S`` is written, and each step of the lineage
changed one term for one reason:

==================  ================================================  =========================
mixer               state update ``S_t = …``                          decay ``α_t``
==================  ================================================  =========================
linear attention    ``S + k vᵀ``                                       none (α = 1)
RetNet              ``γ S + k vᵀ``                                     fixed scalar γ per head
Mamba2              ``α_t S + k vᵀ``                                   data-dependent scalar
DeltaNet            ``(I − β k kᵀ) S + β k vᵀ``                        none
Gated DeltaNet      ``(I − β k kᵀ) α_t S + β k vᵀ``                    data-dependent scalar
KDA                 ``(I − β k kᵀ) Diag(α_t) S + β k vᵀ``              data-dependent, per channel
==================  ================================================  =========================

All functions share fla's layout and calling convention:

* ``q, k``: ``[B, T, H, K]``, ``v``: ``[B, T, H, V]``, state: ``[B, H, K, V]``;
* decays are given in log space (``g = log α ≤ 0``), except RetNet's fixed ``gamma ∈ (0, 1)``;
* ``beta``: ``[B, T, H]`` in ``(0, 1)`` (the delta rule's write strength);
* ``scale`` multiplies ``q`` (default ``K ** -0.5``); callers L2-normalise q and k themselves;
* ``initial_state``: ``[B, H, K, V]`` or ``None`` (zeros);
* return ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] or None)``; the state is kept in
  float32 (float64 if the inputs are float64).

These loops are the ground truth; :mod:`k3lab.mixers.chunk` computes the same outputs in parallel.
"""

import torch

Tensor = torch.Tensor


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (never compute a state in bf16/fp16)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def check_mixer_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    initial_state: Tensor | None,
) -> None:
    """Raise ValueError naming the argument whose shape does not fit fla's layout.

    ``g`` may be ``[B, T, H]`` (scalar decay per head) or ``[B, T, H, K]`` (per channel).
    """
    if q.dim() != 4 or q.shape[1] == 0:
        raise ValueError(f"q must be [B, T, H, K] with T >= 1, got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} = [B, T, H, K], got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if g is not None and g.shape not in ((B, T, H), (B, T, H, K)):
        raise ValueError(f"g must be [B, T, H] = {(B, T, H)} or [B, T, H, K] = {(B, T, H, K)}, got {tuple(g.shape)}")
    if beta is not None and beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(
            f"initial_state must be [B, H, K, V] = {(B, H, K, v.shape[-1])}, got {tuple(initial_state.shape)}"
        )


def check_decay(g: Tensor, mixer: str, per_channel: bool) -> Tensor:
    """Return ``g`` after checking it is ``[B, T, H, K]`` (per_channel) or ``[B, T, H]`` (scalar per head)."""
    if per_channel and g.dim() != 4:
        raise ValueError(f"{mixer} g must be a per-channel log-decay [B, T, H, K], got {tuple(g.shape)}")
    if not per_channel and g.dim() != 3:
        raise ValueError(f"{mixer} g must be a scalar log-decay per head [B, T, H], got {tuple(g.shape)}")
    return g


def retnet_log_decay(gamma: Tensor, q: Tensor) -> Tensor:
    """RetNet's fixed per-head decay ``gamma [H]`` in (0, 1) as a log-decay ``[B, T, H]`` like Mamba2's."""
    B, T, H, _ = q.shape
    if gamma.shape != (H,):
        raise ValueError(f"gamma must be [H] = ({H},), got {tuple(gamma.shape)}")
    if not bool(((gamma > 0) & (gamma <= 1)).all()):
        raise ValueError(f"gamma must lie in (0, 1], got min {gamma.min().item()} max {gamma.max().item()}")
    return torch.log(gamma).expand(B, T, H)


def delta_rule_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = True,
) -> tuple[Tensor, Tensor | None]:
    r"""The one loop behind the whole family; each mixer below is this loop with some terms off.

    Per head, with ``α_t = exp(g_t)`` (scalar or per key channel) and ``q_t`` already scaled::

        S ← Diag(α_t) S                            (forget; skipped when g is None)
        S ← S + k_t (β_t (v_t − Sᵀ k_t))ᵀ          (delta rule; β = None: plain S + k_t v_tᵀ)
        o_t = Sᵀ q_t

    This is the order of fla's ``naive_recurrent_kda`` (docs/k3_reference.md §2.2). Args as in the module
    docstring; ``g``: ``[B, T, H]`` or ``[B, T, H, K]`` log-decay or None; ``beta``: ``[B, T, H]``
    or None.
    """
    check_mixer_inputs(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype, out_dtype = compute_dtype(q, k, v, g, beta, initial_state), v.dtype
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(dtype) for x in (q, k, v))
    q = q * scale
    if g is not None:
        g = g.to(dtype)
        g = g if g.dim() == 4 else g[..., None]  # [B, T, H, K] or [B, T, H, 1]: a scalar broadcasts over K
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)  # [B, H, K, V]
    o = []
    for t in range(T):
        k_t, v_t = k[:, t], v[:, t]  # [B, H, K], [B, H, V]
        # ── RetNet / Mamba2 / Gated DeltaNet / KDA: forget old associations before writing ──
        if g is not None:
            S = torch.exp(g[:, t])[..., None] * S  # α_t: [B, H, K or 1, 1]
        # ── DeltaNet onward: write the *correction* v_t − Sᵀk_t, not v_t (replace, don't pile up) ──
        if beta is not None:
            recalled = torch.einsum("bhk,bhkv->bhv", k_t, S)  # what S returns for k_t now
            v_t = beta[:, t].to(dtype)[..., None] * (v_t - recalled)  # [B, H, V]
        S = S + k_t[..., :, None] * v_t[..., None, :]  # rank-1 write k_t v_tᵀ
        o.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(o, dim=1)  # [B, T, H, V]
    return o.to(out_dtype), (S if output_final_state else None)


def linear_attention_recurrent(q, k, v, scale=None, initial_state=None, output_final_state=True):
    r"""Linear attention (Katharopoulos et al. 2020): ``S_t = S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t``.

    What it is: softmax attention with the exponential kernel dropped, so that
    ``Σ_j (q_tᵀ k_j) v_j = (Σ_j k_j v_jᵀ)ᵀ q_t`` can be summed once into a K×V state instead of
    keeping every key and value. The price: the state only ever grows; nothing is forgotten and a
    new value for an old key piles on top of the old one.
    """
    return delta_rule_recurrent(q, k, v, None, None, scale, initial_state, output_final_state)


def retnet_recurrent(q, k, v, gamma, scale=None, initial_state=None, output_final_state=True):
    r"""RetNet (Sun et al. 2023): ``S_t = γ_h S_{t-1} + k_t v_tᵀ`` with a fixed decay ``gamma [H]`` in (0, 1).

    What changed vs linear attention: a constant forget factor per head, so old associations fade
    geometrically (``γ^{t-j}``) and the state stops growing without bound. Why: recency, and
    different heads with different ``γ`` see different time scales. Still data-independent: the
    model cannot choose *when* to forget.
    """
    g = retnet_log_decay(gamma, q)
    return delta_rule_recurrent(q, k, v, g, None, scale, initial_state, output_final_state)


def mamba2_recurrent(q, k, v, g, scale=None, initial_state=None, output_final_state=True):
    r"""Mamba2 / SSD (Dao & Gu 2024): ``S_t = exp(g_t) S_{t-1} + k_t v_tᵀ``, ``g: [B, T, H]`` log-decay ≤ 0.

    What changed vs RetNet: the decay is computed from the input token (``g_t = -exp(A)·Δ_t``),
    so the model can keep its memory through filler and wipe it at a boundary. Still one scalar
    per head: forgetting is all-or-nothing across the K channels of the state.
    """
    g = check_decay(g, "mamba2", per_channel=False)
    return delta_rule_recurrent(q, k, v, g, None, scale, initial_state, output_final_state)


def deltanet_recurrent(q, k, v, beta, scale=None, initial_state=None, output_final_state=True):
    r"""DeltaNet (Schlag et al. 2021; Yang et al. 2024): ``S_t = (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``.

    What changed vs linear attention: the write is a delta rule, ``S ← S + β k (v − Sᵀk)ᵀ``, one
    step of online regression of ``v`` on ``k``. Why: with ``‖k‖ = 1`` and ``β = 1`` the value
    stored under ``k`` is *replaced* rather than summed, so re-writing a key does not corrupt it
    and the state behaves like an associative memory of up to K orthogonal keys. No decay.
    """
    return delta_rule_recurrent(q, k, v, None, beta, scale, initial_state, output_final_state)


def gated_deltanet_recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True):
    r"""Gated DeltaNet (Yang et al. 2025): ``S_t = (I − β_t k_t k_tᵀ) exp(g_t) S_{t-1} + β_t k_t v_tᵀ``.

    What changed vs DeltaNet: Mamba2's data-dependent scalar decay ``g: [B, T, H]`` in front of the
    delta rule. Why: the delta rule edits one key at a time, but cannot clear the whole memory
    quickly when the context switches; the gate can. The two are complementary.
    """
    g = check_decay(g, "gated_deltanet", per_channel=False)
    return delta_rule_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state)


def kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True):
    r"""KDA, Kimi Delta Attention (docs/k3_reference.md §2.2).

    ``S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ`` with ``α_t = exp(g_t)``.

    What changed vs Gated DeltaNet: the decay is per key channel, ``g: [B, T, H, K]``, so each of
    the K rows of the state forgets at its own data-dependent rate (fine-grained, RoPE-like
    positional information without RoPE). Same semantics and order as fla's
    ``naive_recurrent_kda``: ``S ← exp(g_t) ⊙ S; S ← S + k_t(β_t(v_t − k_tᵀS))ᵀ; o_t = q_tᵀ S``.
    """
    g = check_decay(g, "kda", per_channel=True)
    return delta_rule_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state)
