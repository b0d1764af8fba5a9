"""Chunkwise-parallel forms of the linear-attention lineage (docs/k3_reference.md §2.3).

Same arguments and results as the recurrences in :mod:`k3lab.mixers.lineage`, plus
``chunk_size``. The sequence is cut into chunks of ``C`` tokens (the last one padded internally,
so any ``T`` works); inside a chunk everything is a few ``C×C`` matrix products, and only the
state ``S [B, H, K, V]`` is carried from chunk to chunk. One routine, :func:`delta_rule_chunk`,
serves all six mixers: a scalar decay is the per-channel decay with every channel equal, no decay
is ``g = 0``, and the mixers without the delta rule skip the UT transform (``Ṽ = V``).

Per chunk, with in-chunk cumulative log-decay ``G_r = Σ_{i≤r} g_i`` and ``Γ_r = exp(G_r)``::

    L_ij = β_i Σ_d k_id k_jd exp(G_id − G_jd)   (j < i)       A_ij = Σ_d q_id k_jd exp(G_id − G_jd)   (j ≤ i)
    T    = (I + L)^{-1} Diag(β)          W = T (Γ ⊙ K)          U = T V          (UT / WY transform)
    Ṽ    = U − W S                        (pseudo-values: the delta-rule corrections of the chunk)
    O    = (Γ ⊙ Q) S + A Ṽ
    S'   = Diag(Γ_C) S + (exp(G_C − G) ⊙ K)ᵀ Ṽ

:func:`kda_chunk` also takes packed sequences (fla's ``cu_seqlens``): B = 1 and the token axis holds
N sequences, each run on its own (own chunks, own initial and final state ``[N, H, K, V]``).

For log-decays ``g ≤ 0`` every ``exp`` here is of a non-positive number (``G_i − G_j`` with
``j ≤ i``, ``G_r`` and ``G_C − G_r``), so no factor can overflow however strong the decay. This is
the reference, not the fast tensor-core form that rescales keys by ``1/Γ`` (notebook 03: why K3
bounds ``g ≥ -5``).
"""

import math

import torch
import torch.nn.functional as F

from k3lab.mixers.lineage import check_decay, check_mixer_inputs, compute_dtype, retnet_log_decay
from k3lab.packing import check_cu_seqlens

Tensor = torch.Tensor


def decayed_scores(a: Tensor, b: Tensor, G: Tensor) -> Tensor:
    """``M_ij = Σ_d a_id b_jd exp(G_id − G_jd)`` for ``j ≤ i``, 0 above the diagonal.

    a: ``[..., C, K]`` (a leading extra dim scores several row tensors against one ``b``, sharing the
    decay); b: ``[..., C, K]``; G: ``[..., C, K]`` per channel or ``[..., C, 1]`` one decay for all
    channels (then ``M = (a bᵀ) ⊙ exp(G_i − G_j)`` without the ``[C, C, K]`` tensor). Returns ``[..., C, C]``.
    """
    C = a.shape[-2]
    keep = torch.ones(C, C, dtype=torch.bool, device=a.device).tril()  # [C, C], j ≤ i
    diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~keep[:, :, None], -math.inf)  # [..., C, C, K|1]
    decay = torch.exp(diff)  # ≤ 1 where kept, exactly 0 above the diagonal (and no inf·0 in the backward)
    if G.shape[-1] == 1:
        return (a @ b.transpose(-1, -2)) * decay[..., 0]
    return torch.einsum("...id,...jd,...ijd->...ij", a, b, decay)


# decayed_scores_anchored factors e^{G_i − G_j} while the decay range inside an anchor tile, x = max|G_r − G_a|,
# stays below this fraction of ln(dtype max): every factor then lies in [e^−x, e^x] (fp32: x ≤ 59, max e^88.7)
ANCHORED_RANGE_FRACTION = 2 / 3
ANCHOR_TILES = (16, 8)  # tile sizes tried after the whole chunk (K3's g ≥ −5: 8 tokens span at most 35 < 59)


def decayed_scores_anchored(a: Tensor, b: Tensor, G: Tensor) -> Tensor | None:
    """:func:`decayed_scores` as matmuls, anchored at the first row ``a_r`` of each key tile ``r``::

        M[i, j ∈ tile r] = ( a_i ⊙ e^{G_i − G_{a_r}} ) · ( b_j ⊙ e^{G_{a_r} − G_j} )      (j ≤ i, 0 above)

    Equal in exact arithmetic (``e^{G_i − G_a} e^{G_a − G_j} = e^{G_i − G_j}``). The key factors lie in
    ``[1, e^x]`` with ``x`` the decay range inside a tile, the query factors (rows at or after the tile, where
    ``G_i ≤ G_a``) in ``(0, 1]``; so each product is as accurate as the pairwise one while ``x`` stays well
    inside the exponent range, and a query factor that underflows belongs to a product below ``e^{−ln(max)/3}``.
    Tiles tried: the whole chunk (one matmul), then :data:`ANCHOR_TILES` (``C/c`` matmuls of ``C×K·K×c``,
    a ``[C/c, C, K]`` tensor instead of the pairwise ``[C, C, K]``); returns None when no tile size keeps
    ``x ≤ ANCHORED_RANGE_FRACTION · ln(max)`` of G's dtype (the caller then forms the pairwise tensor).
    Same shapes as :func:`decayed_scores`. The Triton kernels anchor per 16-token tile, which K3's bound
    ``g ≥ −5`` keeps inside bf16 (docs/k3_reference.md §2.3); the range check makes the reference safe for any decay.
    """
    if torch.compiler.is_compiling():  # the range check is a host sync: a compiled graph keeps the pairwise form
        return None
    C = a.shape[-2]
    limit = ANCHORED_RANGE_FRACTION * math.log(torch.finfo(G.dtype).max)
    for c in (C, *ANCHOR_TILES):
        if c > C or C % c:
            continue
        Gt = G.unflatten(-2, (C // c, c))  # [..., nt, c, K]
        anchor = Gt[..., :1, :]  # [..., nt, 1, K]: G at each key tile's first row
        if (Gt - anchor).abs().amax() > limit:
            continue
        rows = torch.arange(C, device=a.device)
        after = rows[None, :, None] >= (torch.arange(C // c, device=a.device) * c)[:, None, None]  # [nt, C, 1]
        q_exp = (G[..., None, :, :] - anchor).masked_fill(~after, 0.0)  # [..., nt, C, K]: ≤ 0 where it is used
        if q_exp.amax() > limit:  # a growing G (g > 0) could overflow the query factor
            continue
        key = (b.unflatten(-2, (C // c, c)) * torch.exp(anchor - Gt)).transpose(-1, -2)  # [..., nt, K, c]
        scores = (a[..., None, :, :] * torch.exp(q_exp)) @ key  # [..., nt, C, c]
        scores = scores.movedim(-3, -2).flatten(-2)  # [..., C, C]: column block r = key tile r
        keep = torch.ones(C, C, dtype=torch.bool, device=a.device).tril()  # [C, C], j ≤ i
        return scores.masked_fill(~keep, 0.0)
    return None


def chunk_scores(a: Tensor, b: Tensor, G: Tensor) -> Tensor:
    """The decayed scores :func:`delta_rule_chunk` uses: :func:`decayed_scores_anchored` (one matmul)
    when it is safe for a per-channel decay, else :func:`decayed_scores` (pairwise)."""
    if G.shape[-1] > 1:
        scores = decayed_scores_anchored(a, b, G)
        if scores is not None:
            return scores
    return decayed_scores(a, b, G)


def to_chunks(x: Tensor, C: int) -> Tensor:
    """``[B, T, H, ...]`` → ``[B, H, N, C, ...]`` with zeros appended to reach ``N·C`` tokens."""
    B, T, H = x.shape[:3]
    N = -(-T // C)
    pad = [0, 0] * (x.dim() - 2) + [0, N * C - T]  # F.pad lists dims from the last one
    x = F.pad(x, pad).reshape(B, N, C, H, *x.shape[3:])
    return x.transpose(1, 3).transpose(2, 3)  # [B, H, N, C, ...]


def delta_rule_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = True,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    r"""Chunkwise form of :func:`k3lab.mixers.lineage.delta_rule_recurrent` (equations in the module docstring).

    ``g``: ``[B, T, H, K]`` or ``[B, T, H]`` log-decay or None; ``beta``: ``[B, T, H]`` or None (no
    delta rule: ``Ṽ = V``). Padding tokens carry ``k = v = q = 0``, ``g = 0``, ``β = 0``, so they
    neither decay nor write the state.
    """
    check_mixer_inputs(q, k, v, g, beta, initial_state)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = min(chunk_size, T)
    dtype, out_dtype = compute_dtype(q, k, v, g, beta, initial_state), v.dtype
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (to_chunks(x.to(dtype), C) for x in (q, k, v))  # [B, H, N, C, K|V]
    q = q * scale
    if g is None:
        g = q.new_zeros(B, T, H, 1)
    g = g.to(dtype) if g.dim() == 4 else g.to(dtype)[..., None]
    G = to_chunks(g, C).cumsum(-2)  # [B, H, N, C, K|1] in-chunk cumulative log-decay
    gamma = torch.exp(G)  # Γ_r
    gamma_last = gamma[..., -1:, :]  # Γ_C [B, H, N, 1, K|1]
    k_to_end = torch.exp(G[..., -1:, :] - G) * k  # K̃_r = exp(G_C − G_r) ⊙ k_r
    if beta is None:
        A = chunk_scores(q, k, G)  # [B, H, N, C, C]
        W, U = None, v
    else:
        A, KK = chunk_scores(torch.stack([q, k]), k, G)  # one decay tensor for both: [B, H, N, C, C] each
        b = to_chunks(beta.to(dtype), C)[..., None]  # [B, H, N, C, 1]
        eye = torch.eye(C, dtype=dtype, device=q.device)
        I_plus_L = eye + b * KK.tril(-1)  # unit lower-triangular, L strictly below the diagonal
        rhs = torch.cat([b * gamma * k, b * v], dim=-1)  # Diag(β) [Γ ⊙ K, V]
        WU = torch.linalg.solve_triangular(I_plus_L, rhs, upper=False, unitriangular=True)
        W, U = WU[..., :K], WU[..., K:]  # W = T (Γ ⊙ K), U = T V
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)
    o = []
    for n in range(q.shape[2]):
        v_new = U[:, :, n] if W is None else U[:, :, n] - W[:, :, n] @ S  # Ṽ: pseudo-values [B, H, C, V]
        o.append((gamma[:, :, n] * q[:, :, n]) @ S + A[:, :, n] @ v_new)  # [B, H, C, V]
        S = gamma_last[:, :, n].transpose(-1, -2) * S + k_to_end[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(o, dim=2).permute(0, 2, 3, 1, 4).reshape(B, -1, H, V)[:, :T]  # [B, T, H, V]
    return o.to(out_dtype), (S if output_final_state else None)


def linear_attention_chunk(q, k, v, scale=None, initial_state=None, output_final_state=True, chunk_size=64):
    """Chunkwise :func:`k3lab.mixers.lineage.linear_attention_recurrent`: ``O = QS + tril(QKᵀ)V``."""
    return delta_rule_chunk(q, k, v, None, None, scale, initial_state, output_final_state, chunk_size)


def retnet_chunk(q, k, v, gamma, scale=None, initial_state=None, output_final_state=True, chunk_size=64):
    """Chunkwise :func:`k3lab.mixers.lineage.retnet_recurrent` (fixed decay ``gamma [H]``)."""
    g = retnet_log_decay(gamma, q)
    return delta_rule_chunk(q, k, v, g, None, scale, initial_state, output_final_state, chunk_size)


def mamba2_chunk(q, k, v, g, scale=None, initial_state=None, output_final_state=True, chunk_size=64):
    """Chunkwise :func:`k3lab.mixers.lineage.mamba2_recurrent` (scalar log-decay ``g [B, T, H]``)."""
    g = check_decay(g, "mamba2", per_channel=False)
    return delta_rule_chunk(q, k, v, g, None, scale, initial_state, output_final_state, chunk_size)


def deltanet_chunk(q, k, v, beta, scale=None, initial_state=None, output_final_state=True, chunk_size=64):
    """Chunkwise :func:`k3lab.mixers.lineage.deltanet_recurrent` (UT transform, no decay)."""
    return delta_rule_chunk(q, k, v, None, beta, scale, initial_state, output_final_state, chunk_size)


def gated_deltanet_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, chunk_size=64):
    """Chunkwise :func:`k3lab.mixers.lineage.gated_deltanet_recurrent` (scalar decay + UT transform)."""
    g = check_decay(g, "gated_deltanet", per_channel=False)
    return delta_rule_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)


def kda_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, chunk_size=64, *,
              cu_seqlens=None):
    """Chunkwise :func:`k3lab.mixers.lineage.kda_recurrent` (docs/k3_reference.md §2.3): per-channel ``g [B, T, H, K]``.

    The torch reference the KDA layer and the Triton kernels are checked against. Returns
    ``(o [B, T, H, V], final_state [B, H, K, V] float32/float64 or None)``.

    ``cu_seqlens`` (int ``[N + 1]``, ``0 = cu_seqlens[0] < ... < cu_seqlens[N] = T``): the inputs are
    ``[1, T, ...]`` and hold N sequences packed along T, run one by one (:func:`check_cu_seqlens`);
    ``initial_state`` and the final state are then ``[N, H, K, V]``.
    """
    g = check_decay(g, "kda", per_channel=True)
    if cu_seqlens is None:
        return delta_rule_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)
    check_mixer_inputs(q, k, v, g, beta, None)
    bounds = check_cu_seqlens(cu_seqlens, q, v, initial_state)
    runs = [
        delta_rule_chunk(*(x[:, bos:eos] for x in (q, k, v, g, beta)), scale,
                         None if initial_state is None else initial_state[n:n + 1], output_final_state, chunk_size)
        for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:]))
    ]
    o = torch.cat([o_n for o_n, _ in runs], dim=1)  # [1, T, H, V]
    return o, (torch.cat([S_n for _, S_n in runs]) if output_final_state else None)  # [N, H, K, V]
