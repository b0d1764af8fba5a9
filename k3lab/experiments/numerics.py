"""Why K3 bounds the KDA gate at ``g ≥ -5``: the chunk form's ``exp(±G)`` factors and where they overflow
(docs/k3_reference.md §2.3 "Lower bound and the e^80 argument"; notebook 03).

Inside a tile of ``C`` tokens the chunk form needs the decayed scores
``A_ij = Σ_d q_id k_jd exp(G_id − G_jd)`` (``j ≤ i``), with ``G_r = Σ_{s≤r} g_s`` the in-tile
cumulative log-decay. Formed per position pair (:func:`pairwise_chunk_attention`) every factor is
``≤ 1``, but that is a ``[C, C, K]`` elementwise product, not a matrix multiply. A tensor core wants
``A = (Q ⊙ Γ)(K ⊙ Γ^{-1})ᵀ`` with ``Γ = exp(G)`` (:func:`factored_chunk_attention`): a ``C×K`` by
``K×C`` matmul, but now ``Γ^{-1} = exp(−G)`` is as large as the whole tile's decay is deep. It stays
finite only while ``−G_C`` is below ``ln(max)`` of the dtype: 88.7 for bf16 and fp32, 11.1 for fp16.
With K3's ``g > -5`` a 16-token tile has ``G_C > -80``, so ``Γ^{-1} < e^80`` and bf16 holds it.
"""

import math

import torch

from k3lab.config import KDA_GATE_LOWER_BOUND
from k3lab.mixers.chunk import decayed_scores, to_chunks
from k3lab.mixers.kda import inverse_softplus_dt_bias, kda_gate, l2norm
from k3lab.testing import rel_err

Tensor = torch.Tensor

# fla's chunk_kda, Kimi Linear's softplus gate vs K3's safe_gate (docs/k3_reference.md §2.3, docs/peer_figures.md §1):
# median ms, bf16, H=16, head dim 128, q/k L2-normalised, gates precomputed in fp32.
# Rows: (B, T, softplus fwd, safe fwd, softplus fwd+bwd, safe fwd+bwd).
FLA_SAFE_GATE_RUNS = [
    {
        "measured": "2026-11-29, time_fla_chunk_kda below: one NVIDIA H200 (141 GB), driver 580, "
                    "torch 2.11.0+cu130, triton 3.6.0, fla 0.6.0, triton.testing.do_bench medians",
        "rows": [(8, 4096, 1.754, 1.553, 9.928, 8.143), (2, 16384, 2.135, 1.930, 11.005, 9.236),
                 (1, 65536, 5.365, 4.957, 25.449, 21.871)],
    },
    {
        "measured": "2026-11-29, k3lab.mixers.numerics.time_fla_chunk_kda: one NVIDIA H200, driver 580.159.04, "
                    "torch 2.11.0+cu130, triton 3.6.0, fla 0.6.0, triton.testing.do_bench medians",
        "rows": [(8, 4096, 1.757, 1.549, 10.252, 7.755), (2, 16384, 2.162, 1.954, 11.395, 8.900),
                 (1, 65536, 5.422, 5.017, 26.155, 21.213)],
    },
]


def log_range(dtype: torch.dtype) -> tuple[float, float]:
    """``(ln smallest normal, ln largest finite)`` of a float dtype: bf16/fp32 ≈ (−87.3, 88.7), fp16 ≈ (−9.7, 11.1)."""
    info = torch.finfo(dtype)
    return math.log(info.smallest_normal), math.log(info.max)


def tile_log_decay(g: Tensor, tile_size: int) -> Tensor:
    """In-tile cumulative log-decay ``G_r = Σ_{s≤r} g_s``: g ``[B, T, H, K]`` → ``[B, H, N, C, K]`` float64."""
    return to_chunks(g.double(), tile_size).cumsum(-2)


def sample_log_decay(kind: str, shape: tuple, logit_scale: float, generator: torch.Generator | None = None,
                     lower_bound: float = KDA_GATE_LOWER_BOUND) -> Tensor:
    """Log-decays ``g [B, T, H, K]`` of one gate kind from raw forget logits ``z ~ logit_scale · N(0, 1)``.

    A_log and dt_bias as the KDA layer initialises them (K3: ``A = 0``; Kimi Linear: ``A ~ log U(1, 16)``),
    so both kinds see the same logits and differ only in the activation (docs/k3_reference.md §2.1).
    """
    B, T, H, K = shape
    z = logit_scale * torch.randn(B, T, H, K, generator=generator)
    if kind == "k3":
        A_log = torch.zeros(H)
    else:
        A_log = torch.empty(H).uniform_(1, 16, generator=generator).log()
    dt_bias = inverse_softplus_dt_bias(H * K, generator=generator)
    return kda_gate(z, A_log, dt_bias, kind, lower_bound)


def factored_chunk_attention(q: Tensor, k: Tensor, v: Tensor, g: Tensor, tile_size: int,
                             dtype: torch.dtype = torch.bfloat16) -> Tensor:
    r"""Intra-tile output ``O_i = Σ_{j≤i} A_ij v_j`` the tensor-core way, with the decay factored in ``dtype``.

    ``Γ = exp(G)`` and ``Γ^{-1} = exp(−G)`` are rounded to ``dtype`` (an overflow becomes ``inf``,
    an underflow ``0``), then ``A = tril((Q ⊙ Γ)(K ⊙ Γ^{-1})ᵀ)`` (the upper triangle dropped with a
    ``where``, as a kernel masks it) and ``O = A V`` are products in ``dtype``.
    q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H, K]`` log-decay. Returns ``o [B, T, H, V]``
    in float64, inf/NaN included: counting them is the point.
    """
    B, T, H, _ = q.shape
    G = tile_log_decay(g, tile_size)  # [B, H, N, C, K]
    gamma, inv_gamma = torch.exp(G).to(dtype), torch.exp(-G).to(dtype)
    qc, kc, vc = (to_chunks(x, tile_size).to(dtype) for x in (q, k, v))  # [B, H, N, C, K|V]
    A = (qc * gamma) @ (kc * inv_gamma).transpose(-1, -2)  # [B, H, N, C, C]
    C = A.shape[-1]
    keep = torch.ones(C, C, dtype=torch.bool, device=A.device).tril()
    A = torch.where(keep, A, torch.zeros((), dtype=dtype))
    o = A @ vc  # [B, H, N, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(B, -1, H, v.shape[-1])[:, :T].double()


def pairwise_chunk_attention(q: Tensor, k: Tensor, v: Tensor, g: Tensor, tile_size: int) -> Tensor:
    """The float64 reference for :func:`factored_chunk_attention`: ``exp(G_i − G_j) ≤ 1`` per position pair."""
    B, T, H, _ = q.shape
    G = tile_log_decay(g, tile_size)
    qc, kc, vc = (to_chunks(x.double(), tile_size) for x in (q, k, v))
    o = decayed_scores(qc, kc, G) @ vc  # [B, H, N, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(B, -1, H, v.shape[-1])[:, :T]


def factored_errors(q: Tensor, k: Tensor, v: Tensor, g: Tensor, tile_size: int, dtypes) -> dict:
    """Compare :func:`factored_chunk_attention` in each of ``dtypes`` with the float64 pairwise reference.

    Returns ``{dtype: row}``, each row a dict: ``rel_err`` over the output rows (token, head) that came
    out finite (NaN if none), ``nonfinite_rows`` (fraction of rows with an inf or NaN), ``n_inf`` and
    ``n_nan`` (output entries), ``min_tile_log_decay`` (the deepest ``G`` of any tile and channel:
    the key factor overflows once it is below −ln(max) of the dtype).
    """
    ref = pairwise_chunk_attention(q, k, v, g, tile_size)
    deepest = tile_log_decay(g, tile_size).min().item()
    rows = {}
    for dtype in dtypes:
        got = factored_chunk_attention(q, k, v, g, tile_size, dtype)
        finite = torch.isfinite(got).all(-1)  # [B, T, H]
        rows[dtype] = {
            "rel_err": rel_err(got[finite], ref[finite]) if bool(finite.any()) else math.nan,
            "nonfinite_rows": 1.0 - finite.double().mean().item(),
            "n_inf": int(torch.isinf(got).sum()),
            "n_nan": int(torch.isnan(got).sum()),
            "min_tile_log_decay": deepest,
        }
    return rows


def time_fla_chunk_kda(B: int, T: int, H: int = 16, D: int = 128, safe_gate: bool = True, backward: bool = True,
                       device: str = "cuda") -> float:
    """Median milliseconds of fla's ``chunk_kda`` for one shape, as the recorded ``FLA_SAFE_GATE_RUNS`` were measured.

    bf16 q/k/v (q, k L2-normalised), β ∈ (0, 1), float32 gates precomputed from ``z ~ N(0, 1)``:
    ``safe_gate=True``: K3's ``g = -5 σ(z)`` with ``safe_gate=True, lower_bound=-5`` (tensor-core diagonal tiles);
    ``False``: Kimi Linear's ``g = -softplus(z)`` (A = 0) on the token-parallel diagonal path. CUDA only;
    fla autotunes on the first call (minutes without a cache).
    """
    import triton
    from fla.ops.kda import chunk_kda

    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q, k = (l2norm(rand(B, T, H, D)).bfloat16() for _ in range(2))
    v, beta = rand(B, T, H, D), torch.rand(B, T, H, generator=gen, device=device).bfloat16()
    kind = "k3" if safe_gate else "kimi_linear"
    g = kda_gate(rand(B, T, H, D, dtype=torch.float32), torch.zeros(H, device=device),
                 torch.zeros(H * D, device=device), kind)
    leaves = [x.requires_grad_(backward) for x in (q, k, v, g, beta)]
    kw = dict(safe_gate=True, lower_bound=KDA_GATE_LOWER_BOUND) if safe_gate else {}
    do = torch.randn_like(v)

    def step():
        o, _ = chunk_kda(*leaves, **kw)
        if backward:
            o.backward(do)

    return triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")
