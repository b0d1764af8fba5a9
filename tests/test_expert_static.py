"""MoonEP with fixed shapes (k3lab.parallel.expert_static, issue 37): the device planner equals the host planner, and
the bounds its fixed buffers rest on hold. The dispatcher's forward and backward against one process at 2, 3, 4 and 8
gloo ranks are in tests/test_moonep_property.py; its capture on a GPU in tests/test_predict_scaling.py."""
import numpy as np
import pytest
import torch

from k3lab.parallel.expert import plan_moonep, route_counts
from k3lab.parallel.expert_static import exchange_reference, plan_moonep_torch, route_counts_torch


def count_matrices(seed: int, n: int):
    """``n`` random ``tpe [R, E]`` (equal S·K per row): spread, Zipf-like, one hot expert per rank, all on one home
    rank, exactly balanced."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        R = int(rng.choice([2, 3, 4, 5, 8]))
        El = int(rng.integers(1, 7))
        E, K, S = R * El, int(rng.integers(1, 4)), int(rng.integers(1, 24))
        K = min(K, E)
        case = i % 5
        rows = []
        for _ in range(R):
            if case == 0:
                p = rng.dirichlet(np.ones(E))
            elif case == 1:
                p = 1.0 / np.arange(1, E + 1) ** 1.3
            elif case == 2:
                p = np.full(E, 0.1 / E)
                p[rng.integers(E)] += 0.9
            elif case == 3:
                p = np.zeros(E)
                p[:El] = 1.0
            else:
                rows.append(np.full(E, S * K // E) + (np.arange(E) < S * K % E))
                continue
            rows.append(rng.multinomial(S * K, p / p.sum()))
        yield K, torch.from_numpy(np.stack(rows).astype(np.int64))


def test_device_plan_equals_the_host_plan():
    """Round for round the same greedy: alloc, quota, home loads and route counts equal (600 count matrices)."""
    n = 0
    for K, tpe in count_matrices(0, 600):
        ref = plan_moonep(tpe, K, check=False)
        alloc, quota, home_load = plan_moonep_torch(tpe)
        assert torch.equal(alloc, ref.alloc) and torch.equal(quota, ref.quota), tpe
        assert torch.equal(home_load, ref.home_load)
        assert torch.equal(route_counts_torch(tpe, alloc), route_counts(ref))
        n += int(ref.moved > 0)
    assert n > 300  # most matrices lend something: the rounds are exercised


def test_the_fixed_buffers_hold_every_plan():
    """What the fixed shapes rest on: every rank computes exactly S·K slots, holds at most El replicas, and each home
    rank lends at most El + R − 2 (expert, receiver) pairs (over the same 600 matrices)."""
    worst = 0
    for K, tpe in count_matrices(1, 600):
        R, E = tpe.shape
        El = E // R
        plan = plan_moonep(tpe, K, check=False)
        assert plan.slots.tolist() == [int(tpe[0].sum())] * R
        assert int(plan.num_replicas.max()) <= El
        pairs = plan.replicas.view(R, El, R).sum((1, 2))                                # [R] pairs a home lends
        assert int(pairs.max()) <= El + R - 2, (tpe, pairs)
        worst = max(worst, int(pairs.max()) - El)
    assert worst >= 1  # some home lent a split expert to two receivers: the R − 2 is needed


def test_the_reference_exchange_refuses_an_overfull_buffer():
    """More rows to receive than the fixed buffer holds is named before any collective runs."""
    x = torch.arange(12.0).view(6, 2)
    with pytest.raises(ValueError, match="4 rows to receive, the fixed buffer holds 3"):
        exchange_reference(x, torch.tensor([4]), torch.tensor([4]), 3, None)


def _own_rows(x, send, recv, rows_out, group):
    """A stand-in exchange for one process: this rank's own rows, zero-padded to ``rows_out`` (as the fake group
    returns them); no host read."""
    k = min(rows_out, x.shape[0])
    return torch.cat([x[:k], x.new_zeros(rows_out - k, *x.shape[1:])])


def _own_rows_host(x, send, recv, rows_out, group):
    """:func:`_own_rows` as an exchange that wants its split sizes on the host (as ``exchange_reference``)."""
    assert send.device.type == recv.device.type == "cpu"
    return _own_rows(x, send, recv, rows_out, group)


_own_rows_host.host_splits = True


def test_one_host_read_a_forward_eager_and_compiled():
    """With an exchange that reads its split sizes on the host, the dispatcher copies a forward's four split vectors
    (rows and weight rows, out and in) to the host once, eager and compiled (the three exchanges reuse the copy
    across the graph breaks), where reading each exchange's sizes took three device syncs a MoE layer."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 — registers the "fake" backend

    from k3lab.config import ModelConfig
    from k3lab.moe.latent import LatentMoE
    from k3lab.parallel.expert import apply_expert_parallel
    from k3lab.parallel.expert_static import apply_static_moonep

    cfg = ModelConfig.preset("tiny").replace(n_routed_experts=8, num_experts_per_tok=2)
    dist.init_process_group("fake", rank=0, world_size=2, store=dist.HashStore())
    try:
        for compiled in (False, True):
            torch.manual_seed(0)
            moe = apply_static_moonep(apply_expert_parallel(LatentMoE(cfg), None), None, _own_rows_host)
            if compiled:
                torch._dynamo.reset()
                moe.compile(backend="aot_eager")
            for forwards in (1, 2):
                moe(torch.randn(2, 16, cfg.hidden_size)).sum().backward()
                assert moe.dispatcher.host_reads == forwards, (compiled, moe.dispatcher.host_reads)
    finally:
        dist.destroy_process_group()


@pytest.mark.traced
def test_the_expert_call_is_compiled_between_the_collectives():
    """Under torch.compile (fit's compile="sublayer") only the dispatcher's collectives run eager: the plan, both row
    orders and the grouped expert call are traced, so the experts' activation is fused as it is with the local
    dispatcher (on an H100 the whole-run-eager dispatcher left the EP rank 2.9× slower than the FSDP rank, 2026-12-07).
    The compiled MoE equals the eager one, forward and backward (rank 0 of a 2-rank fake group, 4 experts each).
    The traced counts are ``scatter_add_`` (inductor's atomic adds), not ``index_add_``: inductor lowers that to
    the sort-based ``index_put_(accumulate=True)`` kernel on CUDA, two per MoE layer, 26 ms of a 233 ms EP rank
    step on one H100 (2026-12-07)."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 — registers the "fake" backend

    from k3lab.config import ModelConfig
    from k3lab.moe.latent import LatentMoE
    from k3lab.parallel.expert import apply_expert_parallel
    from k3lab.parallel.expert_static import apply_static_moonep
    from k3lab.testing import assert_close, eager_and_compiled

    cfg = ModelConfig.preset("tiny").replace(n_routed_experts=8, num_experts_per_tok=2)
    traced = []

    def recording(gm, example_inputs):  # what dynamo traced, then AOTAutograd without code generation
        for n in gm.graph.nodes:
            if n.op in ("call_function", "call_method"):
                accumulate = "index_put" in str(n.target) and (n.args[3:4] or [n.kwargs.get("accumulate")])[0]
                traced.append(f"{n.target}(accumulate)" if accumulate else str(n.target))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def build():
        moe = apply_static_moonep(apply_expert_parallel(LatentMoE(cfg, expert_impl="padded"), None), None, _own_rows)
        moe.experts.static_capacity = True  # the padded path reads no capacity back (GraphedForwardBackward's)
        return moe

    dist.init_process_group("fake", rank=0, world_size=2, store=dist.HashStore())
    try:
        eager, compiled = eager_and_compiled(build, lambda: torch.randn(2, 16, cfg.hidden_size), recording)
    finally:
        dist.destroy_process_group()
    for name in ("y", "x", "experts.w1", "experts.w2"):
        assert_close(f"compiled static MoonEP, {name}", eager[name], compiled[name], 1e-5)
    assert any("bmm" in t for t in traced), "the expert call ran outside every compiled graph"
    assert any("searchsorted" in t for t in traced), "the plan's destinations ran outside every compiled graph"
    slow = sorted({t for t in traced if "index_add" in t or "accumulate" in t})
    assert not slow, f"accumulating index ops traced (sort-based index_put on CUDA): {slow}"


def _compiled_vs_eager(device: str, backend: str, static_capacity: bool, impl: str = "auto",
                       compile_backend: str = "inductor") -> dict:
    """Relative errors of the static dispatcher's MoE compiled (``compile_backend``) against the same MoE eager on
    ``device``, forward and backward (rank 0 of a 2-rank fake group, 4 experts each, the stand-in exchange;
    ``impl``: the experts' path, ``static_capacity``: the padded path's capacity fixed at S or read back)."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 — registers the "fake" backend

    from k3lab.config import ModelConfig
    from k3lab.moe.latent import LatentMoE
    from k3lab.parallel.expert import apply_expert_parallel
    from k3lab.parallel.expert_static import apply_static_moonep
    from k3lab.testing import eager_and_compiled, rel_err

    cfg = ModelConfig.preset("tiny").replace(n_routed_experts=8, num_experts_per_tok=2, backend=backend)

    def build():
        moe = apply_static_moonep(apply_expert_parallel(LatentMoE(cfg, impl), None), None, _own_rows).to(device)
        moe.experts.static_capacity = static_capacity
        return moe

    dist.init_process_group("fake", rank=0, world_size=2, store=dist.HashStore())
    try:
        eager, compiled = eager_and_compiled(build, lambda: torch.randn(4, 64, cfg.hidden_size, device=device),
                                             compile_backend)
    finally:
        dist.destroy_process_group()
    names = ("y", "x", "experts.w1", "experts.w3", "experts.w2", "routed_expert_down_proj.weight", "gate.weight")
    return {name: rel_err(compiled[name], eager[name]) for name in names}


@pytest.mark.traced
def test_the_static_dispatcher_compiled_by_inductor_equals_eager_on_cpu():
    """Inductor's CPU code for the plan, the row orders and the padded experts (capacity read back, and fixed)
    against eager: fp32 within 1e-5, every output and gradient."""
    for static_capacity in (False, True):
        errs = _compiled_vs_eager("cpu", "torch", static_capacity)
        assert max(errs.values()) <= 1e-5, (static_capacity, errs)


@pytest.mark.gpu
def test_the_compiled_static_dispatcher_on_cuda_equals_eager():
    """What ``ep_plan="device"`` runs on CUDA: the device-planned dispatcher compiled by inductor (its plan, row
    orders and expert call as generated kernels; the fused row kernels with backend "auto") equals the same MoE eager
    on the GPU, forward and backward, fp32 within 1e-4. Every variant is computed before the assert, so one failure
    shows what it follows: the backend (fused rows and the triton router and projections, or torch), the padded
    experts' capacity (read back or fixed at S), or the experts' path (padded or the reference loop). Failed on one
    H100 on 2026-12-07 under torch 2.11, every variant alike (the output equal, the experts' w1 gradients 100% off):
    torch 2.11's dynamo traced :class:`~k3lab.moe.situ.SiTUGLUFunction` wrong (on a CPU too); compiled, the
    activation is now plain ops, and the test passed on the same H100 that day."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    variants = [("auto", "padded", False), ("torch", "padded", False), ("auto", "padded", True),
                ("auto", "reference", False)]
    errs = {v: _compiled_vs_eager("cuda", v[0], v[2], v[1]) for v in variants}
    report = "; ".join(f"backend={b}, impl={i}, static_capacity={s}: " + ", ".join(f"{k} {v:.1e}" for k, v in e.items())
                       for (b, i, s), e in errs.items())
    assert all(max(e.values()) <= 1e-4 for e in errs.values()), report


def test_chunks_must_split_the_tokens_evenly():
    """``ep_chunks`` cuts a layer's tokens into equal chunks (fixed buffer shapes): 128 tokens in 3 are refused,
    naming the option; in 2 they run, each chunk's plan giving every rank half the slots."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 — registers the "fake" backend

    from k3lab.config import ModelConfig
    from k3lab.moe.latent import LatentMoE
    from k3lab.parallel.expert import apply_expert_parallel
    from k3lab.parallel.expert_static import apply_static_moonep

    cfg = ModelConfig.preset("tiny").replace(n_routed_experts=8, num_experts_per_tok=2)
    x = torch.randn(2, 64, cfg.hidden_size)
    dist.init_process_group("fake", rank=0, world_size=2, store=dist.HashStore())
    try:
        for chunks in (3, 2):
            torch.manual_seed(0)
            moe = apply_static_moonep(apply_expert_parallel(LatentMoE(cfg), None), None, _own_rows, chunks=chunks)
            if chunks == 3:
                with pytest.raises(ValueError, match=r"128 tokens do not split into ParallelOptions.ep_chunks=3"):
                    moe(x)
            else:
                assert moe(x).shape == x.shape
                assert moe.dispatcher.last_slots_per_rank.tolist() == [128 * 2] * 2  # two chunks of 64 · K each
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_chunks_on_a_communication_stream_equal_the_same_chunks_in_line():
    """``ParallelOptions.ep_chunks=2`` on CUDA: each chunk's exchanges on the communication stream, its experts waiting
    on its own exchanges only, give what the same two chunks give with the exchanges in line on the caller's stream:
    the output and every gradient within 1e-6 (fp32), eager and compiled (rank 0 of a 2-rank fake group, the
    stand-in exchange)."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 — registers the "fake" backend

    from k3lab.config import ModelConfig
    from k3lab.moe.latent import LatentMoE
    from k3lab.parallel.expert import apply_expert_parallel
    from k3lab.parallel.expert_static import apply_static_moonep
    from k3lab.testing import assert_close, eager_and_compiled

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = ModelConfig.preset("tiny").replace(n_routed_experts=8, num_experts_per_tok=2)

    def build(stream):
        return lambda: apply_static_moonep(apply_expert_parallel(LatentMoE(cfg), None), None, _own_rows, chunks=2,
                                           comm_stream=stream).to("cuda")

    def make_input():
        return torch.randn(4, 64, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).cuda()

    dist.init_process_group("fake", rank=0, world_size=2, store=dist.HashStore())
    try:
        in_line = eager_and_compiled(build(None), make_input, "inductor")
        beside = eager_and_compiled(build(torch.cuda.Stream()), make_input, "inductor")
    finally:
        dist.destroy_process_group()
    for want, got in zip(in_line, beside):
        for key, ref in want.items():
            if ref is not None:
                assert_close(key, ref, got[key], 1e-6)


def test_default_exchange_is_the_reference_outside_its_block():
    """``apply_static_moonep`` without an exchange takes :func:`current_exchange`: the reference, or inside
    ``default_exchange(fn)`` (how a timing harness gives ``fit`` its capturable stand-in) ``fn``, nested blocks
    restoring the one before."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 — registers the "fake" backend

    from k3lab.config import ModelConfig
    from k3lab.moe.latent import LatentMoE
    from k3lab.parallel.expert import apply_expert_parallel
    from k3lab.parallel.expert_static import apply_static_moonep, current_exchange, default_exchange

    cfg = ModelConfig.preset("tiny").replace(n_routed_experts=8, num_experts_per_tok=2)
    built = lambda: apply_static_moonep(apply_expert_parallel(LatentMoE(cfg), None), None).dispatcher.exchange  # noqa
    dist.init_process_group("fake", rank=0, world_size=2, store=dist.HashStore())
    try:
        assert built() is exchange_reference
        with default_exchange(_own_rows):
            assert built() is _own_rows
            with default_exchange(_own_rows_host):
                assert built() is _own_rows_host
            assert built() is _own_rows
        assert built() is exchange_reference and current_exchange() is exchange_reference
    finally:
        dist.destroy_process_group()


def _home_zero_routing(rank: int, world: int):
    """A MoonEP-laid-out MoE of 4 experts a rank (tiny preset, top-2, seed 0) and this rank's 16 tokens, every one
    routed to home rank 0's experts (so rank 0 lends): ``(E, moe, width, idx [S, K], z [S, L], topk_weight [S, K])``,
    ``width`` = 3·I·L, the length of a replica weight row."""
    from k3lab.config import ModelConfig
    from k3lab.moe.latent import LatentMoE
    from k3lab.parallel.expert import apply_expert_parallel

    E, K, S = 4 * world, 2, 16
    cfg = ModelConfig.preset("tiny").replace(n_routed_experts=E, num_experts_per_tok=K)
    torch.manual_seed(0)
    base = apply_expert_parallel(LatentMoE(cfg).train(), None, "moonep")
    width = 3 * base.experts.w1.shape[1] * base.experts.w1.shape[2]                     # 3·I·L: a weight row
    g = torch.Generator().manual_seed(rank)
    idx = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(S)])           # [S, K]: home 0's experts
    z = torch.randn(S, base.experts.w1.shape[2], generator=g)                           # [S, L]
    return E, base, width, idx, z, torch.rand(S, K, generator=g)


def _replica_dtypes_worker(rank: int, world: int) -> dict:
    """One skewed MoE forward and backward under CPU autocast (bf16), twice for each dispatcher (the fixed-shape one
    and the host-planned one): the replica weights crossing as the matmuls read them (bf16), and as fp32
    (``matmul_dtype`` pinned to the parameters' dtype, the earlier form). The dtypes the weight exchange saw, the
    replicas lent, the output and every gradient of each."""
    import copy

    import k3lab.parallel.expert as expert_module
    from k3lab.parallel.expert_static import apply_static_moonep

    E, base, width, idx, z, w = _home_zero_routing(rank, world)
    out = {}
    for travel in ("matmul dtype", "fp32", "host plan, matmul dtype", "host plan, fp32"):
        seen = []

        def exchange(x, send, recv, rows_out, group, **orders):
            if x.shape[-1] == width:
                seen.append(x.dtype)
            return exchange_reference(x, send, recv, rows_out, group, **orders)

        exchange.host_splits = exchange_reference.host_splits
        exchange.places_rows = exchange_reference.places_rows
        if travel.startswith("host plan"):  # the host-planned dispatcher's autograd all-to-all, recorded alike
            moe = copy.deepcopy(base)
            real = expert_module.all_to_all
            expert_module.all_to_all = lambda x, *a: (seen.append(x.dtype) if x.shape[-1] == width else None,
                                                      real(x, *a))[1]
        else:
            moe = apply_static_moonep(copy.deepcopy(base), None, exchange)
        if travel.endswith("fp32"):
            moe.experts.matmul_dtype = lambda x: torch.float32
        zz, ww = z.clone().requires_grad_(), w.clone().requires_grad_()
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = moe.dispatcher.run(zz, idx, ww, moe.experts)                         # [S, L]
            y.float().sum().backward()
        finally:
            if travel.startswith("host plan"):
                expert_module.all_to_all = real
        alloc = moe.dispatcher.last_plan.alloc if travel.startswith("host plan") else moe.dispatcher.last_alloc
        home = torch.arange(E)[:, None] // 4 == torch.arange(world)[None]               # [E, R]
        out[travel] = dict(dtypes=seen, lent=int((alloc.gt(0) & ~home).sum()), y=y.detach(),
                           grads=[t.grad for t in (zz, ww, moe.experts.w1, moe.experts.w3, moe.experts.w2)])
    return out


def test_replica_weights_cross_in_the_dtype_the_experts_multiply_in():
    """Under autocast the experts multiply in bf16, so the replica weights cross the exchange in bf16 (half the
    bytes of the fp32 parameters: on one H200 the K3 slice's weight exchanges were 29.6 of its 33.4 GB of
    all-to-all, in fp32) and their gradients come back in bf16, as the matmuls produce them. At 2 gloo ranks, every
    token on home rank 0's experts (so rank 0 lends), the output and every gradient equal, bit for bit, the same
    step with the weights crossing in fp32: for the fixed-shape dispatcher and for the host-planned one."""
    from k3lab.parallel.spawn import run_ranks

    for rank, res in enumerate(run_ranks(_replica_dtypes_worker, 2)):
        for plan in ("", "host plan, "):  # the fixed-shape dispatcher, and the host-planned one (expert.py)
            mine, fp32 = res[plan + "matmul dtype"], res[plan + "fp32"]
            assert mine["lent"] > 0, "the routing lends no expert: the test would not move a weight"
            assert set(mine["dtypes"]) == {torch.bfloat16} and set(fp32["dtypes"]) == {torch.float32}, (plan, mine)
            assert torch.equal(mine["y"], fp32["y"]), (plan, rank, (mine["y"] - fp32["y"]).abs().max())
            for name, a, b in zip(("z", "topk_weight", "w1", "w3", "w2"), mine["grads"], fp32["grads"]):
                assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), (plan, rank, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_casting_and_picking_in_one_op_equals_the_two_ops(dtype):
    """``cast_and_pick``: the home weights cast to the matmul dtype and the rows a rank may lend picked from them, with
    one gradient for the weights: the values of ``w.to(dtype)`` and ``w.index_select(0, pick).to(dtype)`` bit for bit;
    the fp32 gradient bit for bit where no row is picked twice, and to fp32 rounding where one is (an expert lent
    to two ranks: the same terms in another order). Padding rows come back with zero gradients."""
    from k3lab.parallel.expert_static import cast_and_pick

    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, 4, generator=g, requires_grad=True)
    for pick, exact in ((torch.tensor([2, 0, 4, 1]), True), (torch.tensor([2, 0, 2, 4, 0, 0]), False)):
        g_low = torch.randn(5, 3, 4, generator=g).to(dtype)
        g_picked = torch.randn(len(pick), 3, 4, generator=g).to(dtype)
        g_picked[-1] = 0                                                                # a padding row: not sent
        low, picked = w.to(dtype), w.index_select(0, pick).to(dtype)
        ((low.float() * g_low.float()).sum() + (picked.float() * g_picked.float()).sum()).backward()
        want, w.grad = w.grad.clone(), None
        got_low, got_picked = cast_and_pick(w, pick, dtype)
        ((got_low.float() * g_low.float()).sum() + (got_picked.float() * g_picked.float()).sum()).backward()
        assert got_low.dtype == got_picked.dtype == dtype
        assert torch.equal(got_low, low) and torch.equal(got_picked, picked)
        assert w.grad.dtype == torch.float32
        if exact:
            assert torch.equal(w.grad, want)
        else:
            torch.testing.assert_close(w.grad, want, rtol=1e-6, atol=1e-6)
        w.grad = None


def _reads_rows_worker(rank: int, world: int) -> dict:
    """One skewed MoE forward and backward (fp32) with the fixed-shape dispatcher, the weight exchange the reference
    (it reads the first sum(send) rows of its send buffer): once handed the whole buffer (El + R − 2 rows), once
    through an exchange whose ``reads_rows`` is the number of pairs the first run lent. The rows the weight exchange
    was handed, the pairs lent, the output and every gradient of each."""
    import copy

    from k3lab.parallel.expert_static import apply_static_moonep

    E, base, width, idx, z, w = _home_zero_routing(rank, world)
    out, reads = {}, None
    for kind in ("whole buffer", "reads_rows"):
        handed = []

        def weights(x, send, recv, rows_out, group, **orders):
            assert x.shape[-1] == width
            handed.append(x.shape[0])
            return exchange_reference(x, send, recv, rows_out, group, **orders)

        weights.host_splits, weights.places_rows = True, True
        if kind == "reads_rows":
            weights.reads_rows = reads
        moe = apply_static_moonep(copy.deepcopy(base), None, exchange_reference, weight_exchange=weights)
        zz, ww = z.clone().requires_grad_(), w.clone().requires_grad_()
        y = moe.dispatcher.run(zz, idx, ww, moe.experts)                                 # [S, L]
        y.sum().backward()
        alloc = moe.dispatcher.last_alloc                                                # [E, R]
        home = torch.arange(E)[:, None] // 4 == torch.arange(world)[None]               # [E, R]
        pairs = (alloc.gt(0) & ~home).view(world, 4, world).sum((1, 2))                 # [R] pairs each home lends
        reads = int(pairs.max()) if reads is None else reads
        out[kind] = dict(handed=handed, pairs=pairs.tolist(), y=y.detach(),
                         grads=[t.grad for t in (zz, ww, moe.experts.w1, moe.experts.w3, moe.experts.w2)])
    return out


def test_an_exchange_that_reads_fewer_rows_is_handed_only_those():
    """A weight exchange with ``reads_rows`` (``k3lab.parallel.expert_static.Exchange``; ``kernels/
    predict_scaling.py``'s stand-in moving ``lent`` experts' weights) is handed the first ``reads_rows`` rows of the
    send buffer, not MoonEP's bound of El + R − 2 (at K3's widths 118 experts' weights copied a forward and their
    gradient index-added a backward, where a layer lends a few). At 2 gloo ranks, rank 0 lending: with
    ``reads_rows`` = the pairs lent, the reference exchange (which reads the first sum(send) rows) gives the output and
    every gradient of the whole buffer, bit for bit."""
    from k3lab.parallel.spawn import run_ranks

    for rank, res in enumerate(run_ranks(_reads_rows_worker, 2)):
        whole, fewer = res["whole buffer"], res["reads_rows"]
        assert whole["pairs"] == fewer["pairs"] and whole["pairs"][0] > 0 and whole["pairs"][1] == 0, whole["pairs"]
        assert whole["handed"] == [4 + 2 - 2] and fewer["handed"] == [whole["pairs"][0]] < whole["handed"], (
            whole["handed"], fewer["handed"])
        assert torch.equal(whole["y"], fewer["y"]), (rank, (whole["y"] - fewer["y"]).abs().max())
        for name, a, b in zip(("z", "topk_weight", "w1", "w3", "w2"), whole["grads"], fewer["grads"]):
            assert torch.equal(a, b), (rank, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_bank_filled_in_place_equals_the_concatenation(dtype):
    """The expert bank of each weight, built as the dispatcher builds it (``cast_and_pick`` with ``El`` spare rows,
    then ``fill_replicas`` writing the exchanged replica rows into them in place), equals ``torch.cat([w.to(dtype),
    replica rows])`` bit for bit, and so do the gradients of the weights (fp32) and of the replica rows, through
    the same downstream loss; the picked rows too."""
    from k3lab.parallel.expert_static import cast_and_pick, fill_replicas

    g = torch.Generator().manual_seed(1)
    El, shapes = 3, [(2, 4), (2, 4), (4, 2)]                                         # w1, w3 [El, I, L]; w2 [El, L, I]
    ws = [torch.randn(El, *sh, generator=g, requires_grad=True) for sh in shapes]
    got = torch.randn(El, sum(a * b for a, b in shapes), generator=g).to(dtype).requires_grad_()  # [El, 3·I·L]
    pick = torch.tensor([1, 2])
    probes = [torch.randn(2 * El, *sh, generator=g) for sh in shapes]
    p_pick = [torch.randn(len(pick), *sh, generator=g) for sh in shapes]

    def loss(banks, picked):
        return sum((b.float() * p).sum() for b, p in zip(banks, probes)) + sum(
            (q.float() * p).sum() for q, p in zip(picked, p_pick))

    parts = got.split([a * b for a, b in shapes], 1)
    want_banks = [torch.cat([w.to(dtype), part.view(El, *w.shape[1:])]) for w, part in zip(ws, parts)]
    want_picked = [w.index_select(0, pick).to(dtype) for w in ws]
    loss(want_banks, want_picked).backward()
    want_grads = [t.grad.clone() for t in (*ws, got)]
    for t in (*ws, got):
        t.grad = None
    banks, picked = zip(*[cast_and_pick(w, pick, dtype, El) for w in ws])
    banks = fill_replicas(banks, got)
    for a, b in zip((*banks, *picked), (*want_banks, *want_picked)):
        assert a.dtype == dtype and torch.equal(a, b)
    loss(banks, picked).backward()
    for name, a, b in zip(("w1", "w3", "w2", "replica rows"), (*[w.grad for w in ws], got.grad), want_grads):
        assert a.dtype == b.dtype and torch.equal(a, b), name
