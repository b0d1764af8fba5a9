"""Expert parallelism (k3lab.parallel.expert): the MoonEP planner's invariants without processes, then
plain EP and MoonEP over gloo (W = 2, 4 spawned CPU processes) exact against one process."""
import copy
import os
import tempfile
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3lab.config import ModelConfig
from k3lab.moe.latent import LatentMoE, LocalDispatcher, RoutedExperts
from k3lab.moe.router import route_scores
from k3lab.experiments.moe_simulate import skewed_scores
from k3lab.parallel.collectives import all_gather, all_reduce_sum
from k3lab.parallel.expert import (EP_KINDS, ExpertParallelDispatcher, apply_expert_parallel, plan_ep, plan_moonep,
                                   route_counts, tokens_per_expert)
from k3lab.parallel.spawn import rank_context
from k3lab.testing import rel_err

FP32 = 1e-5
TOKENS = 48  # S per rank in the planner tests


# ---------------------------------------------------------------------------------------------- counts
def random_tpe(R, E, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tokens_per_expert(torch.rand(R, TOKENS, E, generator=g).topk(K, -1).indices, E)


def skewed_tpe(R, E, K, seed=0):
    """notebook 08's skewed sigmoid scores (a few hot experts every token likes)."""
    scores = [skewed_scores(TOKENS, E, step=r, skew=2.0, seed=seed) for r in range(R)]
    return tokens_per_expert(torch.stack([route_scores(s, torch.zeros(E), K).topk_idx for s in scores]), E)


def zipf_tpe(R, E, K, seed=0, a=1.2):
    """Top-K sampled without replacement from p_e ∝ 1/(e+1)^a: the hot experts sit on the first home ranks."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** a
    idx = torch.multinomial(p.expand(R * TOKENS, E), K, generator=g).view(R, TOKENS, K)
    return tokens_per_expert(idx, E)


def one_expert_tpe(R, E, K, seed=0):
    """Adversarial (not routable for K > 1, a planner stress): every slot of every rank on expert 0."""
    tpe = torch.zeros(R, E, dtype=torch.int64)
    tpe[:, 0] = TOKENS * K
    return tpe


def one_home_tpe(R, E, K, seed=0):
    """Adversarial: every slot on the experts of home rank R−1, spread as evenly as they allow."""
    El = E // R
    tpe = torch.zeros(R, E, dtype=torch.int64)
    per = torch.full((El,), TOKENS * K // El, dtype=torch.int64)
    per[: TOKENS * K % El] += 1
    tpe[:, E - El:] = per
    return tpe


GENERATORS = {"random": random_tpe, "skewed": skewed_tpe, "zipf": zipf_tpe, "one_expert": one_expert_tpe,
              "one_home": one_home_tpe}


# ---------------------------------------------------------------------------------------------- seam
def test_local_dispatcher_run_is_dispatch_experts_combine_bitwise():
    torch.manual_seed(0)
    experts = RoutedExperts(6, 16, 24)
    z, idx = torch.randn(9, 16), torch.stack([torch.randperm(6)[:2] for _ in range(9)])
    w = torch.rand(9, 2)
    d = LocalDispatcher()
    zs, plan = d.dispatch(z, idx, 6)
    assert torch.equal(d.run(z, idx, w, experts), d.combine(experts(zs, plan.counts), plan, w))


@pytest.mark.parametrize("impl", ["reference", "padded"])
def test_routed_experts_with_given_weights(impl):
    """A bank of given weights (a slice plus replicas) computes what the full module computes."""
    torch.manual_seed(0)
    full = RoutedExperts(8, 16, 24, impl=impl)
    bank = [1, 5, 6]                                                                    # e.g. a slice + replica
    x, counts = torch.randn(10, 16), torch.tensor([4, 0, 6])
    got = full(x, counts, tuple(w[bank] for w in (full.w1, full.w3, full.w2)))
    full_counts = torch.zeros(8, dtype=torch.int64).index_copy(0, torch.tensor(bank), counts)  # [E]
    assert rel_err(got, full(x, full_counts)) < FP32


# ---------------------------------------------------------------------------------------------- planner
def check_moonep_invariants(plan, tpe, K, where=""):
    R, E = tpe.shape
    El, CAP = E // R, int(tpe[0].sum())
    home = torch.arange(E) // El
    count = tpe.sum(0)
    alloc, quota = plan.alloc, plan.quota
    assert (alloc >= 0).all(), where
    assert (plan.slots == CAP).all(), f"{where}: slots {plan.slots.tolist()} != S·K={CAP}"
    assert torch.equal(alloc.sum(1), count), f"{where}: slots of some expert not conserved"
    assert (plan.num_replicas <= El).all(), f"{where}: replicas {plan.num_replicas.tolist()} > E/R={El}"
    # one home per receiver: the quotas, and the homes of the replicas each rank holds
    assert ((quota > 0).sum(0) <= 1).all(), f"{where}: a rank receives from two homes:\n{quota}"
    for d in range(R):
        assert len(set(home[plan.replicas[:, d]].tolist())) <= 1, where
    assert (quota.diagonal() == 0).all(), where
    lent = torch.zeros(R, R, dtype=torch.int64).index_add_(0, home, alloc)               # [h, d]
    assert torch.equal(lent - torch.diag(lent.diagonal()), quota), f"{where}: quota disagrees with alloc"
    # locality: home slots stay home first
    kept = alloc[torch.arange(E), home].view(R, El).sum(1)                               # [R]
    load = plan.home_load
    assert torch.equal(load, count.view(R, El).sum(1)), where
    under = load <= CAP
    assert torch.equal(kept[under], load[under]), f"{where}: an underloaded rank lent slots"
    assert (quota.sum(1)[under] == 0).all(), where
    over = ~under
    receives = quota.sum(0) > 0
    assert (kept[over & ~receives] == CAP).all(), f"{where}: an overloaded rank kept {kept.tolist()} != CAP={CAP}"
    assert ((kept[over & receives] >= 1) & (kept[over & receives] < CAP)).all(), where
    assert int(plan.moved) >= int((load - CAP).clamp_min(0).sum()), where
    donors = plan.donors
    assert torch.equal(donors >= 0, receives), where
    # routing of the slots (step 4)
    n = route_counts(plan)                                                                # [R, E, R]
    assert torch.equal(n.sum(2), tpe) and torch.equal(n.sum(0), alloc), where
    assert (n.sum((0, 1)) == CAP).all(), where


@pytest.mark.parametrize("R", [2, 4, 8])
@pytest.mark.parametrize("E", [8, 16, 64])
@pytest.mark.parametrize("K", [1, 2, 8])
def test_moonep_plan_invariants(R, E, K):
    for name, gen in GENERATORS.items():
        for seed in range(3):
            tpe = gen(R, E, K, seed)
            plan = plan_moonep(tpe, K)
            check_moonep_invariants(plan, tpe, K, f"{name} R={R} E={E} K={K} seed={seed}")
            again = plan_moonep(tpe.clone(), K)
            assert torch.equal(plan.alloc, again.alloc) and torch.equal(plan.quota, again.quota)  # deterministic


def test_moonep_plan_worked_example():
    """R=2, E=4, S·K=12: home 0 holds 20 slots (expert 0: 18, expert 1: 2), home 1 holds 4. Rank 1 is
    filled with 8 slots taken from expert 0 alone (the largest), one replica."""
    tpe = torch.tensor([[10, 2, 0, 0], [8, 0, 2, 2]])
    plan = plan_moonep(tpe, top_k=2)
    assert plan.alloc.tolist() == [[10, 8], [2, 0], [0, 2], [0, 2]]
    assert plan.quota.tolist() == [[0, 8], [0, 0]]
    assert plan.replicas.nonzero().tolist() == [[0, 1]] and plan.donors.tolist() == [-1, 0]
    assert route_counts(plan)[:, 0].tolist() == [[10, 0], [0, 8]]  # rank 0's 10 slots of e0 stay, rank 1's stay


def test_moonep_chain_when_the_surplus_is_smaller_than_the_deficit():
    """Loads (8, 4, 6), CAP 6: rank 0 (surplus 2) fills rank 1 (deficit 2) — balanced in one round; then a
    case where the largest surplus (3) is smaller than the largest deficit (5): the donor goes negative."""
    plan = plan_moonep(torch.tensor([[4, 0, 1, 1, 0, 0], [4, 0, 1, 1, 0, 0], [0, 0, 0, 0, 6, 0]]), top_k=1)
    assert plan.slots.tolist() == [6, 6, 6] and plan.quota.tolist() == [[0, 2, 0], [0, 0, 0], [0, 0, 0]]
    tpe = torch.tensor([[2, 1, 1, 1, 1, 0, 1, 1], [1, 2, 2, 1, 0, 1, 1, 0],
                        [2, 1, 1, 2, 1, 0, 1, 0], [1, 1, 1, 1, 0, 0, 1, 3]])  # loads (11, 10, 3, 8), CAP 8
    plan = plan_moonep(tpe, top_k=1)
    check_moonep_invariants(plan, tpe, 1)
    # round 1: rank 0 (+3) fills rank 2 (−5) and goes to −2; round 2: rank 1 (+2) fills rank 0
    assert plan.quota.tolist() == [[0, 0, 5, 0], [2, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert plan.donors.tolist() == [1, -1, 0, -1]
    assert int(plan.moved) == 7  # > 5 = Σ surplus: the chain's cost of one home per receiver


def test_plain_ep_loads_are_the_home_sums():
    tpe = zipf_tpe(4, 16, 2)
    plan = plan_ep(tpe)
    assert torch.equal(plan.slots, tpe.sum(0).view(4, 4).sum(1))
    assert plan.num_replicas.sum() == 0 and plan.quota.sum() == 0
    assert plan.slots.max() > plan_moonep(tpe, 2).slots.max()  # MoonEP's max load is S·K


def test_planner_and_kind_errors_name_the_field():
    with pytest.raises(ValueError, match="tokens per rank"):
        plan_moonep(torch.tensor([[2, 2], [1, 1]]), top_k=1)
    with pytest.raises(ValueError, match="n_routed_experts=8.*R=3"):
        plan_moonep(torch.zeros(3, 8, dtype=torch.int64), top_k=1)
    moe = LatentMoE(ModelConfig.preset("tiny"))
    for bad in (lambda: apply_expert_parallel(moe, None, kind="deepep"),
                lambda: ExpertParallelDispatcher(None, "all2all", 8)):
        with pytest.raises(ValueError, match=r"kind=.*allowed values are \('moonep', 'ep'\)"):
            bad()
    assert EP_KINDS == ("moonep", "ep")


# ---------------------------------------------------------------------------------------------- spawned
B_PER_RANK, SEQ = 2, 12  # S = 24 tokens per rank

CASES = {  # name -> (config overrides, router skew)
    "tiny": (dict(), None),
    "skewed": (dict(n_routed_experts=16, num_experts_per_tok=4), "zipf"),
    "one_home": (dict(n_routed_experts=16, num_experts_per_tok=4), "one_home"),
    "standard_moe": (dict(mlp_kind="moe"), "zipf"),
}


def build(case: str) -> LatentMoE:
    """The same module on every rank (seeded); skewed routers through larger weights and the bias."""
    overrides, skew = CASES[case]
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny").replace(**overrides)
    moe = LatentMoE(cfg).train()
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    with torch.no_grad():
        if skew == "zipf":
            moe.gate.weight.mul_(10)
            moe.gate.e_score_correction_bias.copy_(-0.3 * torch.log1p(torch.arange(E, dtype=torch.float32)))
        elif skew == "one_home":  # every token picks experts 0..K−1: all on home rank 0
            moe.gate.e_score_correction_bias[:K] = 10.0
    return moe


def compare(case, kind, group, tokens=None):
    """EP copy on this rank's shard vs the single-process module on all tokens of ``group``.
    ``tokens``: per-rank token counts (uneven shards, fed as [1, S_r, D]); default B_PER_RANK × SEQ each."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ref = build(case)
    ep = apply_expert_parallel(copy.deepcopy(ref), group, kind)
    D = ref.gate.weight.shape[1]
    g = torch.Generator().manual_seed(1)
    if tokens is None:
        x = torch.randn(world * B_PER_RANK, SEQ, D, generator=g)
        gy = torch.randn(x.shape, generator=g)
        xs, gs = (t[rank * B_PER_RANK:(rank + 1) * B_PER_RANK] for t in (x, gy))
    else:
        x = torch.randn(1, sum(tokens), D, generator=g)
        gy = torch.randn(x.shape, generator=g)
        lo = sum(tokens[:rank])
        xs, gs = (t[:, lo:lo + tokens[rank]] for t in (x, gy))
    y_ref = ref(x)
    (y_ref * gy).sum().backward()
    y = ep(xs)
    (y * gs).sum().backward()   # a random cotangent: no zero-stride gradients

    if tokens is None:
        y_all = all_gather(y.detach(), group)                                            # [W·b, T, D]
    else:  # uneven shards: gather through a padded buffer (equal all_gather shapes only)
        pad = torch.zeros(1, max(tokens), D)
        pad[:, :tokens[rank]] = y.detach()
        got = all_gather(pad, group)
        y_all = torch.cat([got[r:r + 1, :tokens[r]] for r in range(world)], 1)
    out = {"y": rel_err(y_all, y_ref), "max_abs y": float((y_all - y_ref.detach()).abs().max())}
    ref_params = dict(ref.named_parameters())
    for name, p in ep.named_parameters():
        if p.requires_grad:  # expert slices are gathered, the replicated parameters' grads summed
            grad = all_gather(p.grad, group) if name.startswith("experts.") else all_reduce_sum(p.grad, group)
            out[f"grad {name}"] = rel_err(grad, ref_params[name].grad)
            out[f"max_abs grad {name}"] = float((grad - ref_params[name].grad).abs().max())
    E = ref.num_experts
    load = torch.bincount(ref.gate(x.reshape(-1, D)).topk_idx.reshape(-1), minlength=E)      # [E]
    plan = ep.dispatcher.last_plan
    out.update(slots=ep.dispatcher.last_slots_per_rank.tolist(), home_sums=load.view(world, -1).sum(1).tolist(),
               replicas=plan.num_replicas.tolist(), target=xs.shape[0] * xs.shape[1] * ref.top_k,
               num_local=ep.experts.w1.shape[0])
    return out


def run_checks(group) -> dict:
    """Every check at one EP group size; returns plain numbers and error messages."""
    world = dist.get_world_size(group)
    res = {(case, kind): compare(case, kind, group) for case in CASES for kind in EP_KINDS}
    uneven = [B_PER_RANK * SEQ + 3 * r for r in range(world)]
    res[("uneven", "ep")] = compare("skewed", "ep", group, tokens=uneven)
    errors = {}
    try:
        compare("skewed", "moonep", group, tokens=uneven)
    except ValueError as e:
        errors["uneven moonep"] = str(e)
    try:
        apply_expert_parallel(LatentMoE(ModelConfig.preset("tiny").replace(n_routed_experts=2 * world - 1)),
                              group, "moonep")
    except ValueError as e:
        errors["indivisible"] = str(e)
    res["errors"] = errors
    return res


WORLD = 4  # one spawn: EP over all 4 ranks, and over the two groups {0, 1}, {2, 3} (W = 2)


def worker(rank, init_file, result_dir):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's all_gather_into_tensor rename
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
        res = {4: run_checks(None), 2: run_checks(pairs[rank // 2])}
        torch.save(res, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned():
    """{W: [results of each rank of one W-rank EP group]} for W = 2, 4."""
    with tempfile.TemporaryDirectory() as tmp:
        method = rank_context().get_start_method()  # ranks forked from a server that imported torch and k3lab once
        mp.start_processes(worker, args=(os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=True, start_method=method)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    return {4: [r[4] for r in ranks], 2: [r[2] for r in ranks[:2]], "other pair": [r[2] for r in ranks[2:]]}


@pytest.mark.parametrize("world", [2, 4])
def test_ep_and_moonep_match_one_process(spawned, world):
    results = spawned[world]
    worst = {}
    for key, out in results[0].items():
        if key == "errors":
            continue
        for name, err in out.items():
            if name == "y" or name.startswith("grad "):
                assert err <= FP32, f"W={world} {key} {name}: relative error {err:.2e}"
            if name.startswith("max_abs"):
                assert err <= FP32, f"W={world} {key} {name}: {err:.2e}"
            if name.startswith(("y", "grad ", "max_abs")):
                worst[name] = max(worst.get(name, 0.0), err)
    print(f"\nW={world} worst errors over all cases:", {k: f"{v:.1e}" for k, v in worst.items()})
    if world == 2:  # the second pair ran the same checks on its own group
        assert spawned["other pair"][0][("skewed", "moonep")] == results[0][("skewed", "moonep")]


@pytest.mark.parametrize("world", [2, 4])
def test_loads_moonep_exact_ep_home_sums(spawned, world):
    results = spawned[world]
    for key in results[0]:
        if key == "errors":
            continue
        case, kind = key
        for res in results:
            out = res[key]
            assert out["slots"] == results[0][key]["slots"]  # every rank recorded the same plan
            if kind == "moonep":
                assert out["slots"] == [out["target"]] * world, f"{key}: {out['slots']}"
                assert max(out["replicas"]) <= out["num_local"], key
                if case in ("skewed", "one_home"):
                    assert sum(out["replicas"]) > 0, key  # the replica weights (and their grads) were used
            else:
                assert out["slots"] == out["home_sums"] and sum(out["replicas"]) == 0, key
        if case in ("skewed", "one_home"):
            assert len(set(results[0][key]["home_sums"])) > 1  # the case is really unbalanced
    one_home = results[0][("one_home", "ep")]["home_sums"]
    assert one_home[1:] == [0] * (world - 1)  # plain EP: rank 0 computes everything


@pytest.mark.parametrize("world", [2, 4])
def test_spawned_errors_name_the_field(spawned, world):
    for res in spawned[world]:
        assert "tokens per rank S" in res["errors"]["uneven moonep"]
        assert f"n_routed_experts={2 * world - 1}" in res["errors"]["indivisible"]


def test_moonep_lending_counts_what_the_host_planner_lends():
    """k3lab.experiments.moe_simulate.moonep_lending (the replica counts behind predict_scaling's lent=): its first
    step, with no balancer (bias 0), counted again from the same routing by the host planner; every step within
    MoonEP's bound E/R; and Quantile Balancing brings the batch's max violation down where no balancer does not."""
    from k3lab.experiments.moe_simulate import moonep_lending
    from k3lab.moe.router import route_scores

    n, k, R, S = 64, 4, 4, 256
    plain = moonep_lending("none", n, k, R, S, steps=3, warmup=0, skew=1.0, seed=3)
    route = route_scores(skewed_scores(R * S, n, 0, 1.0, 0.0, 3), torch.zeros(n), k)
    tpe = torch.zeros(R, n, dtype=torch.int64).scatter_add_(
        1, route.topk_idx.reshape(R, S * k), torch.ones(R, S * k, dtype=torch.int64))  # [R, E]
    plan = plan_moonep(tpe, k)
    assert plain["borrowed"][0] == int(plan.num_replicas.max()) > 0
    assert plain["lent"][0] == int(plan.replicas.view(R, n // R, R).sum((1, 2)).max())
    balanced = moonep_lending("quantile_hist", n, k, R, S, steps=6, warmup=3, skew=1.0, seed=3)
    for run in (plain, balanced):
        assert run["bound"] == n // R and max(run["borrowed"]) <= n // R
    assert max(balanced["max_violation"]) < min(plain["max_violation"])
