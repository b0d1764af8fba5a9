r"""KCP: context parallelism for K3's two token mixers, exact against one process.

The W ranks of a CP group each hold a slice of every sequence (``x [B, T/W, D]``); everything
token-local (projections, gates, norms, MLPs) runs unchanged, and only the two mixers talk.

**Layouts** (:data:`CP_LAYOUTS`). The sequence is cut into ``P`` equal parts of ``T_p = T/P`` tokens::

    contiguous   P = W    rank r holds part r                   tokens [r·T/W, (r+1)·T/W)
    zigzag       P = 2W   rank r holds parts r and 2W−1−r       (balances causal attention work)

A rank's local tensor is its parts concatenated in that order. Needs ``T % P == 0`` and, for
KDA, ``T_p ≥ short_conv_kernel_size − 1`` (the conv halo comes from one neighbouring part). No
multiple of the chunk size 64 is needed: ``kda_chunk`` pads its last chunk internally and the
Triton kernels mask it, so any ``T_p`` is exact (a multiple of 64 only avoids a padded chunk).

**KDA: the affine chain.** Per head, one token's update is affine in the state ``S [K, V]``::

    S_t = A_t S_{t−1} + β_t k_t v_tᵀ,     A_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t})   [K, K]
    o_t = scale · S_tᵀ q_t

Unrolled over one part (tokens a..t) from an incoming state ``S_in``::

    S_t = M_t S_in + S̃_t,          M_t = A_t A_{t−1} ⋯ A_a,   S̃_t = the same run from S = 0
    o_t = o⁰_t + r_tᵀ S_in,        o⁰_t = scale · S̃_tᵀ q_t,   r_t = scale · M_tᵀ q_t   [K]

One mixer call yields all four. Run it with values ``[v | 0_K]`` (width V+K) from the state
``[0_{K×V} | I_K]``: the extra K columns are never written (their values are 0), only carried,
``M_t = A_t M_{t−1}``, ``M_{a−1} = I``; so the final state is ``[S̃ | M]`` and the output's extra
columns are ``r_t``. The ranks then all-gather each part's ``[S̃_p | M_p]`` (``[B, H, K, V+K]``
float32: O(K(V+K)) numbers a head, whatever T), and every rank folds the prefix in global part order::

    S_in(0) = 0,     S_in(p+1) = M_p S_in(p) + S̃_p          (M_p acts on the K rows)

and corrects its outputs, ``o_t = o⁰_t + r_tᵀ S_in(p)``. Cost: the mixer on V+K value columns
(2× the value work for K = V) plus at most P−1 products ``[K, K]·[K, V]`` a head. The mixer is the
layer's own ``KDA.mix``, so the backend switch (torch ``kda_chunk``, Triton, fla) still applies.

**KDA short-conv halo.** The causal depthwise convs of q, k, v read the ``W_c − 1`` projected
inputs before a part: the previous part's last rows (zeros for part 0), all-gathered once for
the three convs together and passed as ``conv_state [B, D, W_c − 1]`` (oldest first).

**KDA cache under CP.** ``KDA.forward`` takes no cache (error otherwise) and returns the true
:class:`KDACache` after this rank's last local part: state ``M S_in + S̃`` (one extra product) and
that part's conv tails. On the rank holding the sequence's last part (contiguous: W−1, zigzag: 0)
that is the global final cache; elsewhere it is the cache at the end of the rank's own tokens.

**Gated MLA.** All-gather the compact latent ``[c_kv | k_rope]`` (kv_lora + rope numbers a token,
not the per-head K/V), put it in global order, and attend each local query over it in the naive
form with the causal mask from global positions (``key_pos ≤ query_pos``; keys past the rank's
last query are dropped). RoPE (``mla_use_nope=False``) rotates at global positions. ``max_logit``
is each rank's own max (the trainer all-reduces MAX).

**Autograd.** Both gathers are :func:`k3lab.parallel.collectives.all_gather` (backward:
reduce-scatter SUM), so parameter gradients are per-rank partial sums (the trainer's gradient
reduction over the CP group adds them). Every rank keeps every gathered tensor in its graph
(:func:`keep_in_graph` where the value is not needed, e.g. contiguous rank 0), or the others hang
in the backward. Backward collectives run in the same order on every rank: the state gather's
gradient must be complete before the halo gather's (the halo feeds q, k, v, which feed the state).

Layers never import this module; they call the methods of the :class:`CPContext` they were handed
(``layer.cp``): ``short_convs`` and ``kda_mix`` (KDA), ``positions`` and ``mla_attend`` (MLA).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from k3lab.parallel.collectives import all_gather, keep_in_graph

ProcessGroup = dist.ProcessGroup

CP_LAYOUTS = ("contiguous", "zigzag")

# mix(q, k, v, g, beta, initial_state) -> (o [B, T, H, V'], final_state [B, H, K, V']), e.g. KDA.mix
MixFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass
class CPContext:
    """One rank's view of a context-parallel group.

    group: the CP process group (None = the default group); rank, world: this rank's index in it and
    its size; layout: one of :data:`CP_LAYOUTS`. Build it with :meth:`from_group` inside a run.
    """

    group: ProcessGroup | None
    rank: int
    world: int
    layout: str = "contiguous"

    def __post_init__(self):
        if self.layout not in CP_LAYOUTS:
            raise ValueError(f"layout={self.layout!r}: allowed values are {CP_LAYOUTS}")
        if not isinstance(self.world, int) or isinstance(self.world, bool) or self.world < 1:
            raise ValueError(f"world={self.world!r}: must be an integer >= 1")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 0 <= self.rank < self.world:
            raise ValueError(f"rank={self.rank!r}: must be an integer in [0, world={self.world})")

    @classmethod
    def from_group(cls, group: ProcessGroup | None = None, layout: str = "contiguous") -> "CPContext":
        """The context of the calling process in ``group`` (an initialized process group)."""
        return cls(group, dist.get_rank(group), dist.get_world_size(group), layout)

    # --- layout ---------------------------------------------------------------------------------
    @property
    def parts_per_rank(self) -> int:
        """1 (contiguous) or 2 (zigzag)."""
        return 1 if self.layout == "contiguous" else 2

    @property
    def num_parts(self) -> int:
        """P: the number of equal parts a sequence is cut into (W or 2W)."""
        return self.world * self.parts_per_rank

    def parts_of(self, rank: int) -> tuple[int, ...]:
        """Global part indices held by ``rank``, in its local order."""
        return (rank,) if self.layout == "contiguous" else (rank, 2 * self.world - 1 - rank)

    @property
    def local_parts(self) -> tuple[int, ...]:
        return self.parts_of(self.rank)

    def owner(self, part: int) -> tuple[int, int]:
        """``(rank, slot)``: who holds global part ``part`` and at which of its local slots."""
        if not 0 <= part < self.num_parts:
            raise ValueError(f"part={part}: must be in [0, num_parts={self.num_parts})")
        if part < self.world:
            return part, 0
        return 2 * self.world - 1 - part, 1

    def part_length(self, T_local: int, field: str = "T_local") -> int:
        """``T_p = T_local / parts_per_rank``, checked."""
        n = self.parts_per_rank
        if T_local < n or T_local % n:
            raise ValueError(f"{field}={T_local}: layout={self.layout!r} needs a positive multiple of {n} local "
                             f"tokens (the global T must be divisible by {self.num_parts})")
        return T_local // n

    def positions(self, T_local: int, device=None, rank: int | None = None) -> Tensor:
        """Global positions ``[T_local]`` (int64) of the local tokens of ``rank`` (default: this rank)."""
        Tp = self.part_length(T_local)
        rank = self.rank if rank is None else rank
        return torch.cat([torch.arange(p * Tp, (p + 1) * Tp, device=device) for p in self.parts_of(rank)])

    # --- KDA ------------------------------------------------------------------------------------
    def short_convs(self, convs: Sequence, xs: Sequence[Tensor], cache=None) -> list[tuple[Tensor, Tensor]]:
        """KDA's short convolutions with the halo from the previous part (one all-gather for all of them).

        convs: ``ShortConvolution`` modules (same kernel ``W_c``); xs: their projected inputs
        ``[B, T_local, D_i]``. Returns ``[(y_i [B, T_local, D_i], tail_i [B, D_i, W_c−1])]``, the tail
        being the last ``W_c − 1`` inputs of this rank's last local part. ``cache`` must be None.
        """
        if cache is not None:
            raise ValueError("cache: must be None under context parallelism (layer.cp is set): a CP forward "
                             "runs whole sequences from position 0; decode without CP")
        n, B, T_local = self.parts_per_rank, xs[0].shape[0], xs[0].shape[1]
        Tp = self.part_length(T_local)
        halo_len = convs[0].weight.shape[-1] - 1
        if any(c.weight.shape[-1] - 1 != halo_len for c in convs):
            raise ValueError(f"convs: all kernels must have one size, got {[c.weight.shape[-1] for c in convs]}")
        if Tp < halo_len:
            raise ValueError(f"T_local={T_local}: each of this rank's {n} part(s) has {Tp} tokens, fewer than "
                             f"short_conv_kernel_size − 1 = {halo_len} (the conv halo comes from one neighbouring "
                             "part); use fewer CP ranks or longer sequences")
        parts = [_split_parts(x, n) for x in xs]  # [n·B, T_p, D_i]
        if halo_len == 0:
            states = [None] * len(parts)
        else:
            widths = [u.shape[-1] for u in parts]
            tails = torch.cat([u[:, Tp - halo_len:] for u in parts], dim=-1)  # [n·B, W_c−1, ΣD]
            gathered = all_gather(tails, self.group).view(self.world, n, B, halo_len, sum(widths))
            halos, used = [], False
            for part in self.local_parts:
                if part == 0:
                    halos.append(tails.new_zeros(B, halo_len, sum(widths)))
                else:
                    src, slot = self.owner(part - 1)
                    halos.append(gathered[src, slot])  # [B, W_c−1, ΣD]
                    used = True
            halo = torch.cat(halos, dim=0)  # [n·B, W_c−1, ΣD]
            if not used:  # contiguous rank 0: join the gather's backward anyway
                halo = keep_in_graph(halo, gathered)
            states = list(halo.transpose(1, 2).split(widths, dim=1))  # [n·B, D_i, W_c−1], oldest first
        out = []
        for conv, u, state in zip(convs, parts, states):
            y, tail = conv(u, state)  # [n·B, T_p, D_i], [n·B, D_i, W_c−1]
            out.append((_merge_parts(y, n), tail[(n - 1) * B:]))
        return out

    def kda_mix(self, layer, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """:func:`kcp_mix` through ``layer.mix`` (the layer's backend). ``initial_state`` must be None."""
        if initial_state is not None:
            raise ValueError("initial_state: must be None under context parallelism (layer.cp is set)")
        return kcp_mix(q, k, v, g, beta, self, mix=layer.mix)

    def fold(self, gathered: Tensor, V: int) -> list[Tensor | None]:
        """Incoming states of the local parts from the gathered ``[W, n, B, H, K, V+K]`` part maps.

        ``S_in(0) = 0``, ``S_in(p+1) = M_p S_in(p) + S̃_p`` in global part order; None stands for 0.
        """
        need = self.local_parts
        S, s_in = None, {}
        for part in range(max(need)):
            if part in need:
                s_in[part] = S
            src, slot = self.owner(part)
            S_tilde, M = gathered[src, slot, ..., :V], gathered[src, slot, ..., V:]  # [B, H, K, V], [B, H, K, K]
            S = S_tilde if S is None else M @ S + S_tilde
        s_in[max(need)] = S
        return [s_in[part] for part in need]

    # --- MLA ------------------------------------------------------------------------------------
    def mla_attend(self, layer, q_nope: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor,
                   cache=None) -> tuple[Tensor, Tensor, Tensor]:
        """Local queries over the all-gathered latent, causal in global positions (naive form).

        q_nope ``[B, T_local, H, nope]``, q_rope ``[B, T_local, H, rope]``, c_kv ``[B, T_local, R]``,
        k_rope ``[B, T_local, rope]`` (already rotated at global positions under RoPE). Returns
        ``(o [B, T_local, H, V] float32, c_kv_all [B, T, R], k_rope_all [B, T, rope])``, the latter two
        the whole sequence in global order (a full :class:`MLACache` on every rank). Sets
        ``layer.max_logit`` (this rank's queries) when ``layer.training and layer.track_max_logit``.
        """
        if cache is not None:
            raise ValueError("cache: must be None under context parallelism (layer.cp is set): a CP forward "
                             "runs whole sequences from position 0; decode without CP")
        B, T_local, R = c_kv.shape
        latent = torch.cat([c_kv, k_rope], dim=-1)  # [B, T_local, R + rope]
        gathered = all_gather(latent, self.group)  # [W·B, T_local, R + rope], rank-major
        keys = gathered.view(self.world, B, T_local, -1).transpose(0, 1).reshape(B, self.world * T_local, -1)
        if self.layout != "contiguous":  # rank-major -> global order
            key_pos = torch.cat([self.positions(T_local, c_kv.device, rank=s) for s in range(self.world)])
            keys = keys.index_select(1, torch.argsort(key_pos))
        q_pos = self.positions(T_local, c_kv.device)  # [T_local]
        S = int(q_pos.max()) + 1  # keys past the last local query are masked anyway
        c_kv_all, k_rope_all = keys.split([R, keys.shape[-1] - R], dim=-1)
        o = attend_naive_positions(layer, q_nope, q_rope, c_kv_all[:, :S], k_rope_all[:, :S], q_pos,
                                   torch.arange(S, device=c_kv.device))
        return o, c_kv_all, k_rope_all


# --- sequence helpers ------------------------------------------------------------------------------
def _split_parts(x: Tensor, n: int) -> Tensor:
    """``[B, n·T_p, ...]`` -> ``[n·B, T_p, ...]`` (a rank's parts stacked along the batch)."""
    return x if n == 1 else torch.cat(x.chunk(n, dim=1), dim=0)


def _merge_parts(x: Tensor, n: int) -> Tensor:
    """Inverse of :func:`_split_parts`: ``[n·B, T_p, ...]`` -> ``[B, n·T_p, ...]``."""
    return x if n == 1 else torch.cat(x.chunk(n, dim=0), dim=1)


def shard_sequence(x: Tensor, ctx: CPContext, dim: int = 1) -> Tensor:
    """Global ``[B, T, ...]`` -> this rank's ``[B, T/W, ...]`` (its parts, concatenated) along ``dim``."""
    T, P = x.shape[dim], ctx.num_parts
    if T == 0 or T % P:
        raise ValueError(f"T={T} (x.shape[{dim}]): must be a positive multiple of {P} "
                         f"(world={ctx.world} × {ctx.parts_per_rank} part(s) per rank for layout={ctx.layout!r})")
    Tp = T // P
    return torch.cat([x.narrow(dim, p * Tp, Tp) for p in ctx.local_parts], dim=dim)


def unshard_sequence(x: Tensor, ctx: CPContext, dim: int = 1) -> Tensor:
    """This rank's ``[B, T/W, ...]`` -> global ``[B, T, ...]`` on every rank (all-gather, with autograd)."""
    T_local = x.shape[dim]
    y = all_gather(x.movedim(dim, 0), ctx.group)  # [W·T_local, ...], rank-major
    if ctx.layout != "contiguous":
        pos = torch.cat([ctx.positions(T_local, x.device, rank=s) for s in range(ctx.world)])
        y = y.index_select(0, torch.argsort(pos))
    return y.movedim(0, dim)


def global_positions(T_local: int, ctx: CPContext, device=None) -> Tensor:
    """Global positions ``[T_local]`` (int64) of this rank's local tokens."""
    return ctx.positions(T_local, device)


# --- KDA: the affine chain ------------------------------------------------------------------------
def kcp_mix(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ctx: CPContext, *,
            scale: float | None = None, mix: MixFn | None = None) -> tuple[Tensor, Tensor]:
    r"""Context-parallel KDA mix (module docstring): this rank's ``(o [B, T_local, H, V], S [B, H, K, V])``.

    q, k, g: ``[B, T_local, H, K]``, v: ``[B, T_local, H, V]``, beta: ``[B, T_local, H]`` — this rank's
    tokens in ``ctx.layout``. ``mix(q, k, v, g, beta, initial_state) -> (o, final_state)`` runs the
    delta rule (default: ``kda_chunk`` with ``scale``; ``KDA.mix`` carries its own scale). The local
    parts run in one call, stacked along the batch::

        [o⁰ | r], [S̃ | M] = mix(q, k, [v | 0_K], g, beta, [0 | I_K])
        o = o⁰ + r · S_in,   S = M S_in + S̃        (S_in from :meth:`CPContext.fold` over the gathered maps)

    ``S`` is the true state after this rank's last local part (the global final state on the rank
    holding the last part: contiguous rank W−1, zigzag rank 0).
    """
    if mix is None:
        from k3lab.mixers.chunk import kda_chunk

        def mix(q, k, v, g, beta, initial_state):
            return kda_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True)
    B, T_local, H, K = q.shape
    V = v.shape[-1]
    n = ctx.parts_per_rank
    ctx.part_length(T_local)
    q, k, v, g, beta = (_split_parts(t, n) for t in (q, k, v, g, beta))  # [n·B, T_p, H, ·]
    sdt = torch.promote_types(g.dtype, torch.float32)  # state dtype: float32 (float64 in float64 runs)
    v_aug = torch.cat([v, v.new_zeros(*v.shape[:-1], K)], dim=-1)  # [n·B, T_p, H, V+K]
    eye = torch.eye(K, dtype=sdt, device=q.device).expand(n * B, H, K, K)
    s0 = torch.cat([eye.new_zeros(n * B, H, K, V), eye], dim=-1)  # [0 | I]: [n·B, H, K, V+K]
    o_aug, s_aug = mix(q, k, v_aug, g, beta, s0)  # [n·B, T_p, H, V+K], [n·B, H, K, V+K] = [S̃ | M]
    s_aug = s_aug.to(sdt)
    gathered = all_gather(s_aug, ctx.group).view(ctx.world, n, B, H, K, V + K)
    s_in = ctx.fold(gathered, V)
    outs, state = [], None
    for slot, S in enumerate(s_in):
        rows = slice(slot * B, (slot + 1) * B)
        o0, r = o_aug[rows, ..., :V], o_aug[rows, ..., V:]  # [B, T_p, H, V], [B, T_p, H, K]
        S_tilde, M = s_aug[rows, ..., :V], s_aug[rows, ..., V:]  # [B, H, K, V], [B, H, K, K]
        if S is None:  # part 0: S_in = 0
            outs.append(o0)
            state = S_tilde
        else:
            outs.append((o0.to(sdt) + torch.einsum("bthk,bhkv->bthv", r.to(sdt), S)).to(o0.dtype))
            state = M @ S + S_tilde
    o = torch.cat(outs, dim=1)  # [B, T_local, H, V]
    if all(S is None for S in s_in):  # contiguous rank 0 needs nothing gathered, but joins the backward
        o = keep_in_graph(o, gathered)
    return o, state


# --- MLA: attention with global positions ---------------------------------------------------------
def attention_math_positions(q: Tensor, k: Tensor, v: Tensor, scale: float, q_pos: Tensor,
                             k_pos: Tensor) -> tuple[Tensor, Tensor]:
    """``k3lab.mixers.mla.attention_math`` with the causal mask from positions: key j is visible to
    query i iff ``k_pos[j] <= q_pos[i]``.

    q: [B, H, T, K], k: [B, Hk, S, K], v: [B, Hk, S, V]; q_pos [T], k_pos [S] (int).
    Returns (o [B, H, T, V] float32/64, max logit per head [H]).
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.autocast(q.device.type, enabled=False):
        scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale  # [B, H, T, S]
        mask = k_pos[None, :] <= q_pos[:, None]  # [T, S]
        scores = scores.masked_fill(~mask, float("-inf"))
        max_logit = scores.detach().amax(dim=(0, 2, 3))  # [H]
        return torch.matmul(scores.softmax(dim=-1), v.to(dtype)), max_logit


def attend_naive_positions(layer, q_nope: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor,
                           q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``GatedMLA.attend_naive`` (its unfused branch) with position masks. Returns o [B, T, H, V] float32/64."""
    B, S, _ = c_kv.shape
    H, nope, rope, Vh = layer.num_heads, layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim
    kv = layer.kv_b_proj(c_kv).view(B, S, H, nope + Vh)
    k_nope, v = kv.split([nope, Vh], dim=-1)
    k = torch.cat([k_nope, k_rope[:, :, None, :].expand(B, S, H, rope)], dim=-1)  # [B, S, H, nope + rope]
    q = torch.cat([q_nope, q_rope], dim=-1)  # [B, T, H, nope + rope]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T|S, K|V]
    o, max_logit = attention_math_positions(q, k, v, layer.scale, q_pos, k_pos)
    if layer.training and layer.track_max_logit:
        layer.max_logit = max_logit.float()
    return o.transpose(1, 2)
