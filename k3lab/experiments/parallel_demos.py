r"""Module-level workers for the context-parallel notebook (11) and its test, run through
:func:`k3lab.parallel.spawn.run_ranks` (a notebook cannot hand its own functions to spawned processes).

Every worker is ``fn(rank, world, ..., cp=None)`` inside an initialized gloo group; it builds the same
inputs on every rank from a fixed seed, computes the one-process reference itself and returns plain floats
and ints (picklable), this rank's view. ``cp`` (default: ``world``) is the CP group size: the ``world``
processes split into ``world / cp`` groups of consecutive ranks (:func:`cp_context`), each running the
whole demo, so one spawn serves several CP sizes. Errors are ``max|got − ref| / max|ref|`` over this rank's
tokens (the caller takes the max over ranks).

* :func:`kcp_vs_one_process` — the functional :func:`~k3lab.parallel.context.kcp_mix` against
  ``kda_chunk`` on the whole sequence: output, final state and the five input gradients.
* :func:`kda_layer_cp`, :func:`mla_layer_cp` — a whole ``KDA`` / ``GatedMLA`` layer with
  ``layer.cp = CPContext(...)``: output, input gradient, parameter gradients (all-reduced SUM over the
  group, as the trainer's gradient reduction does).
* :func:`comm_bytes` — the bytes a rank puts into ``torch.distributed.all_gather_into_tensor`` (and gets
  back from ``reduce_scatter_tensor`` in the backward) for one KDA and one Gated MLA layer at several T,
  recorded by wrapping the two collectives (:func:`count_collectives`).
* :func:`run_many` — several of the above in one set of processes (each new process imports torch and k3lab:
  about 4 s of CPU).

The byte formulas the measurements are checked against: :func:`kda_cp_bytes`, :func:`mla_latent_bytes`,
:func:`mla_full_kv_bytes`.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
from torch import Tensor

from k3lab.config import KDA_GATE_LOWER_BOUND, ModelConfig
from k3lab.parallel.context import CPContext, kcp_mix, shard_sequence

MIX_NAMES = ("q", "k", "v", "g", "beta")


def max_err(got: Tensor, ref: Tensor) -> float:
    """``max|got − ref| / max|ref|`` in float64."""
    got, ref = got.detach().double(), ref.detach().double()
    if got.shape != ref.shape:
        raise ValueError(f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def kda_inputs(B: int, T: int, H: int, K: int, V: int, seed: int = 0, g_min: float = KDA_GATE_LOWER_BOUND,
               dtype=torch.float32) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Random KDA mixer inputs (same on every rank for one seed): unit-norm q, k; v ~ N(0, 1);
    log-decay ``g = g_min · U(0, 1) ∈ (g_min, 0)`` (near 0: long memory); ``β = σ(N(0, 1))``."""
    from k3lab.mixers.kda import l2norm

    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, K, generator=gen, dtype=dtype))
    k = l2norm(torch.randn(B, T, H, K, generator=gen, dtype=dtype))
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = g_min * torch.rand(B, T, H, K, generator=gen, dtype=dtype)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype))
    return q, k, v, g, beta


_SUBGROUPS: dict = {}


def cp_context(layout: str = "contiguous", cp: int | None = None) -> CPContext:
    """This rank's :class:`CPContext` in a CP group of ``cp`` consecutive ranks (None or the world size:
    the default group). Every rank must call it with the same ``cp`` (creating subgroups is collective)."""
    world = dist.get_world_size()
    if cp is None or cp == world:
        return CPContext.from_group(None, layout)
    if not isinstance(cp, int) or cp < 1 or world % cp:
        raise ValueError(f"cp={cp!r}: must be a positive divisor of the world size {world}")
    key = (id(dist.group.WORLD), cp)
    if key not in _SUBGROUPS:
        _SUBGROUPS[key] = dist.new_subgroups(group_size=cp)[0]
    return CPContext.from_group(_SUBGROUPS[key], layout)


def _holds_last_part(ctx: CPContext) -> bool:
    return ctx.owner(ctx.num_parts - 1)[0] == ctx.rank


def kcp_vs_one_process(rank: int, world: int, T: int = 256, layout: str = "contiguous", seed: int = 0,
                       g_min: float = -0.1, B: int = 2, H: int = 2, K: int = 32, V: int = 32,
                       cp: int | None = None) -> dict:
    """:func:`kcp_mix` on this rank's shard against ``kda_chunk`` on the whole sequence (one process,
    chunks of 64). Returns ``{"o", "dq", "dk", "dv", "dg", "dbeta"[, "state"]: error, "parts": [...]}``
    (``state``: on the rank holding the last part, whose final state is the global one)."""
    from k3lab.mixers.chunk import kda_chunk

    ctx = cp_context(layout, cp)
    inputs = kda_inputs(B, T, H, K, V, seed, g_min)
    w = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(seed + 1))  # loss = Σ w·o
    full = [t.clone().requires_grad_() for t in inputs]
    o_ref, S_ref = kda_chunk(*full, output_final_state=True)
    (o_ref * w).sum().backward()
    local = [shard_sequence(t, ctx).requires_grad_() for t in inputs]
    o, S = kcp_mix(*local, ctx)
    (o * shard_sequence(w, ctx)).sum().backward()
    out = {"o": max_err(o, shard_sequence(o_ref, ctx))}
    for name, t, t_ref in zip(MIX_NAMES, local, full):
        out[f"d{name}"] = max_err(t.grad, shard_sequence(t_ref.grad, ctx))
    if _holds_last_part(ctx):
        out["state"] = max_err(S, S_ref)
    out["parts"] = list(ctx.local_parts)
    out["cp_rank"] = ctx.rank
    return out


def _layer_cp(ctx: CPContext, layer, x: Tensor, seed: int) -> dict:
    """y, dx and all-reduced parameter gradients of ``layer`` under ``ctx`` against one process."""
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1))
    x_full = x.clone().requires_grad_()
    y_ref = layer(x_full)[0]
    (y_ref * w).sum().backward()
    grads_ref = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    layer.cp = ctx
    try:
        x_local = shard_sequence(x, ctx).requires_grad_()
        y = layer(x_local)[0]
        (y * shard_sequence(w, ctx)).sum().backward()
    finally:
        layer.cp = None
    worst = 0.0
    for n, p in layer.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=ctx.group)  # the trainer's gradient reduction over the CP group
        worst = max(worst, max_err(g, grads_ref[n]))
    return {"y": max_err(y, shard_sequence(y_ref, ctx)), "dx": max_err(x_local.grad, shard_sequence(x_full.grad, ctx)),
            "param_grads": worst}


def _tiny_cfg(preset: str) -> ModelConfig:
    return ModelConfig.preset(preset).replace(backend="torch")


def kda_layer_cp(rank: int, world: int, T: int = 128, layout: str = "contiguous", seed: int = 0,
                 preset: str = "tiny", B: int = 2, cp: int | None = None) -> dict:
    """A whole ``KDA`` layer (projections, halo convs, gate, KCP mix, norm, output gate) with
    ``layer.cp`` set, against the same layer on the whole sequence: ``{"y", "dx", "param_grads"}``."""
    from k3lab.mixers.kda import KDA

    torch.manual_seed(seed)
    layer = KDA(_tiny_cfg(preset), 0)
    x = torch.randn(B, T, layer.cfg.hidden_size, generator=torch.Generator().manual_seed(seed + 2))
    return _layer_cp(cp_context(layout, cp), layer, x, seed)


def mla_layer_cp(rank: int, world: int, T: int = 128, layout: str = "contiguous", seed: int = 0,
                 preset: str = "tiny", B: int = 2, cp: int | None = None) -> dict:
    """A whole ``GatedMLA`` layer with ``layer.cp`` set (gathered latent, global-position causal
    mask), against one process: ``{"y", "dx", "param_grads"}``."""
    from k3lab.mixers.mla import GatedMLA

    cfg = _tiny_cfg(preset)
    torch.manual_seed(seed)
    layer = GatedMLA(cfg, layer_idx=cfg.full_attn_layers[0] - 1).train()
    x = torch.randn(B, T, cfg.hidden_size, generator=torch.Generator().manual_seed(seed + 3))
    return _layer_cp(cp_context(layout, cp), layer, x, seed)


# --- communication -------------------------------------------------------------------------------
@contextlib.contextmanager
def count_collectives():
    """Record every ``all_gather_into_tensor`` (bytes of this rank's input) and
    ``reduce_scatter_tensor`` (bytes of this rank's output) while the block runs.

    Yields a list that fills with ``(op, shape, dtype name, bytes)``. k3lab's collectives call
    ``torch.distributed.<op>`` by attribute at call time, so replacing the attribute catches them."""
    calls: list[tuple[str, tuple, str, int]] = []
    orig_ag, orig_rs = dist.all_gather_into_tensor, dist.reduce_scatter_tensor

    def all_gather_into_tensor(output, input, *args, **kwargs):
        calls.append(("all_gather", tuple(input.shape), str(input.dtype).removeprefix("torch."),
                      input.numel() * input.element_size()))
        return orig_ag(output, input, *args, **kwargs)

    def reduce_scatter_tensor(output, input, *args, **kwargs):
        calls.append(("reduce_scatter", tuple(output.shape), str(output.dtype).removeprefix("torch."),
                      output.numel() * output.element_size()))
        return orig_rs(output, input, *args, **kwargs)

    dist.all_gather_into_tensor, dist.reduce_scatter_tensor = all_gather_into_tensor, reduce_scatter_tensor
    try:
        yield calls
    finally:
        dist.all_gather_into_tensor, dist.reduce_scatter_tensor = orig_ag, orig_rs


def comm_bytes(rank: int, world: int, seq_lens=(64, 128, 256, 512), layout: str = "contiguous", seed: int = 0,
               preset: str = "tiny", B: int = 1, cp: int | None = None) -> list[dict]:
    """Forward + backward of one KDA and one Gated MLA layer under CP at each global T in ``seq_lens``;
    returns rows ``{"layer", "T", "T_local", "forward_bytes", "backward_bytes", "calls"}``: the bytes
    this rank sent into the forward all-gathers and got back from the backward reduce-scatters."""
    from k3lab.mixers.kda import KDA
    from k3lab.mixers.mla import GatedMLA

    cfg = _tiny_cfg(preset)
    ctx = cp_context(layout, cp)
    torch.manual_seed(seed)
    layers = {"kda": KDA(cfg, 0), "mla": GatedMLA(cfg, layer_idx=cfg.full_attn_layers[0] - 1).train()}
    rows = []
    for T in seq_lens:
        x = torch.randn(B, T, cfg.hidden_size, generator=torch.Generator().manual_seed(seed + T))
        for name, layer in layers.items():
            layer.cp = ctx
            try:
                x_local = shard_sequence(x, ctx).requires_grad_()
                with count_collectives() as calls:
                    y = layer(x_local)[0]
                    n_fwd = len(calls)
                    y.square().sum().backward()
            finally:
                layer.cp = None
            rows.append({"layer": name, "T": T, "T_local": x_local.shape[1],
                         "forward_bytes": sum(c[3] for c in calls[:n_fwd] if c[0] == "all_gather"),
                         "backward_bytes": sum(c[3] for c in calls[n_fwd:] if c[0] == "reduce_scatter"),
                         "calls": calls})
    return rows


def kda_cp_bytes(B: int, H: int, K: int, V: int, conv_kernel: int, itemsize: int = 4, parts: int = 1,
                 state_itemsize: int = 4) -> dict:
    """Bytes one rank sends per KDA layer (forward): its ``[S̃ | M]`` summaries ``parts·B·H·K·(V+K)``
    float32 numbers, plus the conv halos ``parts·B·(W_c−1)·H·(2K+V)`` activations (q, k and v's last
    ``W_c − 1`` projected inputs; ``3·B·(W_c−1)·H·K`` for K = V). Independent of T."""
    summary = parts * B * H * K * (V + K) * state_itemsize
    halo = parts * B * (conv_kernel - 1) * H * (2 * K + V) * itemsize
    return {"summary": summary, "halo": halo, "total": summary + halo}


def mla_latent_bytes(B: int, T_local: int, kv_lora_rank: int, rope_dim: int, itemsize: int = 4) -> int:
    """Bytes one rank sends per Gated MLA layer (forward): its tokens' latents ``[c_kv | k_rope]``."""
    return B * T_local * (kv_lora_rank + rope_dim) * itemsize


def mla_full_kv_bytes(B: int, T_local: int, H: int, qk_head_dim: int, v_head_dim: int, itemsize: int = 4) -> int:
    """What gathering the expanded per-head keys and values instead would send (ring-attention style)."""
    return B * T_local * H * (qk_head_dim + v_head_dim) * itemsize


def predicted_bytes(cfg: ModelConfig, layer: str, B: int, T_local: int, parts: int = 1, itemsize: int = 4) -> int:
    """The formula for ``layer`` in ("kda", "mla", "mla_full_kv") at ``cfg``'s sizes."""
    lac = cfg.linear_attn_config
    if layer == "kda":
        return kda_cp_bytes(B, lac["num_heads"], lac["head_dim"], lac["head_dim"], lac["short_conv_kernel_size"],
                            itemsize, parts)["total"]
    if layer == "mla":
        return mla_latent_bytes(B, T_local, cfg.kv_lora_rank, cfg.qk_rope_head_dim, itemsize)
    if layer == "mla_full_kv":
        return mla_full_kv_bytes(B, T_local, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                                 cfg.v_head_dim, itemsize)
    raise ValueError(f"layer={layer!r}: allowed values are ('kda', 'mla', 'mla_full_kv')")


# --- batching ------------------------------------------------------------------------------------
def run_many(rank: int, world: int, jobs) -> list:
    """Run ``[(fn, kwargs), ...]`` (module-level functions of this module) one after the other in
    this spawn: returns ``[fn(rank, world, **kwargs), ...]``. Silences torch's FutureWarning that
    ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` are deprecated (k3lab's collectives use them)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use .*_single", category=FutureWarning)
        return [fn(rank, world, **kwargs) for fn, kwargs in jobs]
