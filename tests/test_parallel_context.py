"""KCP (k3lab.parallel.context): context-parallel KDA (affine chain) and Gated MLA (gathered latent)
on CPU gloo, W = 2 and 4, both layouts, against one process on the full sequence; the augmented
``[v | 0], [0 | I]`` call; layouts; errors that name the field.

One spawn per world size runs every multi-process check (each spawn costs seconds on 2 cores);
each rank computes the one-process reference itself and reports normalized max errors
``max|got − ref| / max|ref|``; parameter gradients are all-reduced (SUM) over the group first.
"""

import datetime
import json
import math
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3lab.config import ModelConfig
from k3lab.mixers.chunk import kda_chunk
from k3lab.mixers.kda import KDA, KDACache, l2norm
from k3lab.mixers.lineage import kda_recurrent
from k3lab.mixers.mla import GatedMLA
from k3lab.parallel.context import (CP_LAYOUTS, CPContext, global_positions, kcp_mix, shard_sequence,
                                    unshard_sequence)
from k3lab.parallel.spawn import rank_context

MIX_OUT_TOL = 1e-6  # the functional KCP mix: output
MIX_GRAD_TOL = 1e-5  # ... and dq, dk, dv, dg, dβ
LAYER_TOL = 1e-5  # whole layers: output, input and parameter gradients, cache
FP64_TOL = 1e-10
SPAWN_TIMEOUT_S = 150


def max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got − ref| / max|ref|`` (float64)."""
    got, ref = got.detach().double(), ref.detach().double()
    if got.shape != ref.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def kda_inputs(B=2, T=128, H=2, K=16, V=16, seed=0, dtype=torch.float32):
    """Random KDA mixer inputs: unit q, k; g ∈ (−5, 0); β ∈ (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, K, generator=gen, dtype=dtype))
    k = l2norm(torch.randn(B, T, H, K, generator=gen, dtype=dtype))
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = -5 * torch.rand(B, T, H, K, generator=gen, dtype=dtype).clamp_min(1e-3)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype))
    return q, k, v, g, beta


def kda_layer(seed=0):
    torch.manual_seed(seed)
    layer = KDA(ModelConfig.preset("tiny").replace(backend="torch"), layer_idx=0)
    with torch.no_grad():
        layer.A_log.uniform_(-1, 1)  # off its init so e^A is exercised
    return layer


def mla_layer(nope=True, seed=0):
    torch.manual_seed(seed)
    mla = GatedMLA(ModelConfig.preset("tiny").replace(mla_use_nope=nope), layer_idx=3)
    with torch.no_grad():
        for p in mla.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return mla.train()


# --- multi-process checks (run inside each rank) --------------------------------------------------
def _holds_last_part(ctx: CPContext) -> bool:
    return ctx.owner(ctx.num_parts - 1)[0] == ctx.rank


def _mix_reference(inputs, w, dtype, chunk_size):
    full = [t.detach().to(dtype, copy=True).requires_grad_() for t in inputs]
    o, S = kda_chunk(*full, output_final_state=True, chunk_size=chunk_size)
    (o * w.to(dtype)).sum().backward()
    return o, S, [t.grad for t in full]


def _check_mix(ctx: CPContext) -> dict:
    """KCP mix vs ``kda_chunk`` on the full sequence, chunked at the part boundaries (same in-chunk
    arithmetic, so the gap is the affine-chain decomposition alone); and vs float64 (fp32 noise: the
    one-process float32 ``kda_chunk`` itself is ~1e-6 off float64 on these inputs)."""
    names = ("q", "k", "v", "g", "beta")
    inputs = kda_inputs()
    T_p = inputs[0].shape[1] // ctx.num_parts  # the KCP mix chunks each part at min(64, T_p) = T_p
    w = torch.randn(inputs[2].shape, generator=torch.Generator().manual_seed(7))
    o_ref, S_ref, grads_ref = _mix_reference(inputs, w, torch.float32, T_p)
    o_64, S_64, grads_64 = _mix_reference(inputs, w, torch.float64, 64)
    local = [shard_sequence(t, ctx).requires_grad_() for t in inputs]
    o, S = kcp_mix(*local, ctx)
    (o * shard_sequence(w, ctx)).sum().backward()
    errs = {"mix/o": (max_err(o, shard_sequence(o_ref, ctx)), MIX_OUT_TOL),
            "mix/o_vs_fp64": (max_err(o, shard_sequence(o_64, ctx)), MIX_GRAD_TOL)}
    for name, t, g_ref, g_64 in zip(names, local, grads_ref, grads_64):
        errs[f"mix/d{name}"] = (max_err(t.grad, shard_sequence(g_ref, ctx)), MIX_GRAD_TOL)
        errs[f"mix/d{name}_vs_fp64"] = (max_err(t.grad, shard_sequence(g_64, ctx)), MIX_GRAD_TOL)
    if _holds_last_part(ctx):
        errs["mix/final_state"] = (max_err(S, S_ref), MIX_OUT_TOL)
        errs["mix/final_state_vs_fp64"] = (max_err(S, S_64), MIX_GRAD_TOL)
    errs["unshard"] = (max_err(unshard_sequence(local[2].detach(), ctx), inputs[2]), 0.0)
    return errs


def _check_layer(ctx: CPContext, layer, x: torch.Tensor, prefix: str) -> tuple[dict, object, object]:
    """y, dx and all-reduced parameter grads of ``layer`` under ``ctx`` vs one process; returns the caches too."""
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(11))
    x_full = x.clone().requires_grad_()
    y_ref, cache_ref = layer(x_full)
    (y_ref * w).sum().backward()
    grads_ref = {n: p.grad.clone() for n, p in layer.named_parameters()}
    max_logit_ref = getattr(layer, "max_logit", torch.zeros(1)).clone()
    layer.zero_grad()
    layer.cp = ctx
    try:
        x_local = shard_sequence(x, ctx).requires_grad_()
        y, cache = layer(x_local)
        (y * shard_sequence(w, ctx)).sum().backward()
    finally:
        layer.cp = None
    errs = {f"{prefix}/y": (max_err(y, shard_sequence(y_ref, ctx)), LAYER_TOL),
            f"{prefix}/dx": (max_err(x_local.grad, shard_sequence(x_full.grad, ctx)), LAYER_TOL)}
    worst = 0.0
    for n, p in layer.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=ctx.group)  # the trainer's gradient reduction over CP
        worst = max(worst, max_err(g, grads_ref[n]))
    errs[f"{prefix}/param_grads"] = (worst, LAYER_TOL)
    if isinstance(layer, GatedMLA):
        ml = layer.max_logit.clone()
        dist.all_reduce(ml, op=dist.ReduceOp.MAX, group=ctx.group)
        errs[f"{prefix}/max_logit"] = (max_err(ml, max_logit_ref), LAYER_TOL)
    return errs, cache, cache_ref


def _check_kda(ctx: CPContext) -> dict:
    layer = kda_layer()
    x = torch.randn(2, 128, layer.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    errs, cache, cache_ref = _check_layer(ctx, layer, x, "kda")
    if _holds_last_part(ctx):  # its cache is the global one
        for field in ("recurrent", "conv_q", "conv_k", "conv_v"):
            errs[f"kda/cache.{field}"] = (max_err(getattr(cache, field), getattr(cache_ref, field)), LAYER_TOL)
    return errs


def _check_mla(ctx: CPContext, nope: bool) -> dict:
    layer = mla_layer(nope)
    x = torch.randn(2, 128, layer.o_proj.out_features, generator=torch.Generator().manual_seed(5))
    prefix = "mla_nope" if nope else "mla_rope"
    errs, cache, cache_ref = _check_layer(ctx, layer, x, prefix)
    errs[f"{prefix}/cache.c_kv"] = (max_err(cache.c_kv, cache_ref.c_kv), LAYER_TOL)
    errs[f"{prefix}/cache.k_rope"] = (max_err(cache.k_rope, cache_ref.k_rope), LAYER_TOL)
    return errs


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results = {}
        for layout in CP_LAYOUTS:
            ctx = CPContext.from_group(None, layout)
            checks = {**_check_mix(ctx), **_check_kda(ctx), **_check_mla(ctx, True), **_check_mla(ctx, False)}
            results.update({f"{layout}/{name}": v for name, v in checks.items()})
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tmp_path: Path) -> dict:
    """Run :func:`_worker` on ``world`` gloo ranks; returns ``{check: (max error over ranks, tol)}``."""
    ctx = rank_context()  # ranks forked from a server that has imported torch and k3lab once
    procs = [ctx.Process(target=_worker, args=(r, world, str(tmp_path / "init"), str(tmp_path)))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(SPAWN_TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = [f.read_text() for f in sorted(tmp_path.glob("rank*.err"))]
    codes = [p.exitcode for p in procs]
    if errors or any(c != 0 for c in codes):
        raise AssertionError(f"world={world}: worker exit codes {codes}\n" + "\n".join(errors))
    merged = {}
    for r in range(world):
        for name, (err, tol) in json.loads((tmp_path / f"rank{r}.json").read_text()).items():
            merged[name] = (max(err, merged.get(name, (0.0, tol))[0]), tol)
    return merged


@pytest.mark.parametrize("world", [2, 4])
def test_cp_matches_one_process(world, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    results = _spawn(world, tmp_path)
    print(f"\nworld={world}: " + ", ".join(f"{n}={e:.1e}" for n, (e, _) in sorted(results.items())))
    expected = {f"{layout}/{part}" for layout in CP_LAYOUTS
                for part in ("mix/o", "mix/dq", "mix/dbeta", "mix/final_state", "kda/y", "kda/param_grads",
                             "kda/cache.recurrent", "mla_nope/y", "mla_rope/param_grads", "mla_rope/max_logit")}
    assert expected <= set(results), sorted(expected - set(results))
    bad = {n: f"{e:.2e} > {t:.0e}" for n, (e, t) in results.items() if not e <= t}
    assert not bad, bad


# --- one process ----------------------------------------------------------------------------------
def test_augmented_call_gives_affine_map():
    """``mix(q, k, [v | 0], g, β, [0 | I])`` -> state ``[S̃ | M]``, output ``[o⁰ | r]``, with
    ``M = Π_t (I − β_t k_t k_tᵀ) Diag(e^{g_t})`` (newest on the left) and ``r_t = scale · M_tᵀ q_t``."""
    B, T, H, K, V = 2, 37, 2, 8, 6  # V ≠ K, T not a multiple of the chunk
    q, k, v, g, beta = kda_inputs(B, T, H, K, V, seed=4, dtype=torch.float64)
    scale = K ** -0.5
    v_aug = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)  # [B, T, H, V+K]
    eye = torch.eye(K, dtype=torch.float64).expand(B, H, K, K)
    s0 = torch.cat([eye.new_zeros(B, H, K, V), eye], dim=-1)  # [B, H, K, V+K]
    o_aug, s_aug = kda_chunk(q, k, v_aug, g, beta, scale=scale, initial_state=s0, chunk_size=16)
    o0_ref, S_ref = kda_recurrent(q, k, v, g, beta, scale=scale)  # from zero state
    assert max_err(s_aug[..., :V], S_ref) < FP64_TOL
    assert max_err(o_aug[..., :V], o0_ref) < FP64_TOL
    M, r = eye.clone(), []
    for t in range(T):
        kt, bt = k[:, t], beta[:, t, :, None, None]  # [B, H, K], [B, H, 1, 1]
        A = (eye - bt * kt[..., :, None] * kt[..., None, :]) * g[:, t].exp()[..., None, :]  # (I − βkkᵀ) Diag(e^g)
        M = A @ M
        r.append(scale * torch.einsum("bhkj,bhk->bhj", M, q[:, t]))  # scale · M_tᵀ q_t
    assert max_err(s_aug[..., V:], M) < FP64_TOL
    assert max_err(o_aug[..., V:], torch.stack(r, dim=1)) < FP64_TOL
    S_in = torch.randn(B, H, K, V, dtype=torch.float64)  # the affine map reproduces any incoming state
    o_ref, S_out_ref = kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=S_in)
    o = o_aug[..., :V] + torch.einsum("bthk,bhkv->bthv", o_aug[..., V:], S_in)
    assert max_err(o, o_ref) < FP64_TOL
    assert max_err(M @ S_in + s_aug[..., :V], S_out_ref) < FP64_TOL


@pytest.mark.parametrize("layout", CP_LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_layouts_cover_the_sequence(layout, world):
    T = 12 * world
    x = torch.arange(T)[None, :, None].expand(2, T, 3)  # [B, T, 3]
    seen = []
    for rank in range(world):
        ctx = CPContext(None, rank, world, layout)
        pos = global_positions(T // world, ctx)
        assert torch.equal(shard_sequence(x, ctx)[0, :, 0], pos)
        assert torch.equal(shard_sequence(x.transpose(0, 1), ctx, dim=0)[:, 0, 0], pos)
        assert all(ctx.owner(p) == (rank, slot) for slot, p in enumerate(ctx.local_parts))
        seen.append(pos)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(T))
    if layout == "contiguous":
        assert torch.equal(torch.cat(seen), torch.arange(T))


def test_errors_name_the_field():
    with pytest.raises(ValueError, match=r"layout='ring': allowed values are \('contiguous', 'zigzag'\)"):
        CPContext(None, 0, 2, "ring")
    with pytest.raises(ValueError, match="rank=2"):
        CPContext(None, 2, 2)
    with pytest.raises(ValueError, match="world=0"):
        CPContext(None, 0, 0)
    x = torch.randn(1, 130, 4)
    shard_sequence(x, CPContext(None, 0, 2))  # 130 = 2·65: fine contiguous ...
    with pytest.raises(ValueError, match=r"T=130 .*multiple of 4"):
        shard_sequence(x, CPContext(None, 0, 2, "zigzag"))  # ... but not in 2W = 4 parts
    with pytest.raises(ValueError, match=r"T=127 .*multiple of 2"):
        shard_sequence(x[:, :127], CPContext(None, 1, 2))
    # the layers refuse a cache under CP before any collective runs
    kda = kda_layer()
    kda.cp = CPContext(None, 1, 2)
    cache = KDACache(torch.zeros(1, 2, 32, 32), *(torch.zeros(1, 64, 3) for _ in range(3)))
    with pytest.raises(ValueError, match="cache: must be None under context parallelism"):
        kda(torch.randn(1, 8, 64), cache)
    with pytest.raises(ValueError, match=r"T_local=2: .*short_conv_kernel_size − 1 = 3"):
        kda(torch.randn(1, 2, 64))
    with pytest.raises(ValueError, match="T_local=5: layout='zigzag' needs a positive multiple of 2"):
        kda.cp = CPContext(None, 0, 2, "zigzag")
        kda(torch.randn(1, 5, 64))
    with pytest.raises(ValueError, match="initial_state: must be None"):
        kda.cp.kda_mix(kda, *kda_inputs(1, 8, 2, 32, 32), initial_state=torch.zeros(1, 2, 32, 32))
    mla = mla_layer()
    cache = mla(torch.randn(1, 4, 64))[1]
    mla.cp = CPContext(None, 0, 2)
    with pytest.raises(ValueError, match="cache: must be None under context parallelism"):
        mla(torch.randn(1, 4, 64), cache)


def test_no_cp_is_unchanged():
    """``layer.cp = None`` (the default) is the plain forward: same bits as a fresh layer."""
    for make in (kda_layer, mla_layer):
        layer, fresh = make(), make()
        assert layer.cp is None
        x = torch.randn(2, 20, 64)
        assert torch.equal(layer(x)[0], fresh(x)[0])
    assert math.isclose(KDA(ModelConfig.preset("tiny"), 0).scale, 32 ** -0.5)
