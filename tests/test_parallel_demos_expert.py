"""The expert-parallel notebook's worker (k3lab.experiments.expert_demos): one spawn of 2 gloo processes,
plain EP and MoonEP on the tiny LatentMoE under every router skew, against one process."""
import pytest

from k3lab.experiments import expert_demos as demos_expert
from k3lab.parallel.expert import EP_KINDS
from k3lab.parallel.spawn import run_ranks

FP32 = 1e-5
WORLD = 2


@pytest.fixture(scope="module")
def results():
    """[rank] -> {(skew, kind): compare(...)} of the one EP group of 2 ranks."""
    return [res[WORLD] for res in run_ranks(demos_expert.ep_vs_one_process, WORLD)]


def test_output_and_grads_match_one_process(results):
    for rank, res in enumerate(results):
        assert set(res) == {(s, k) for s in demos_expert.ROUTER_SKEWS for k in EP_KINDS}
        for key, out in res.items():
            assert out["y"] <= FP32, f"rank {rank} {key}: output relative error {out['y']:.2e}"
            for name, err in out["grads"].items():
                assert err <= FP32, f"rank {rank} {key} grad {name}: relative error {err:.2e}"
            assert out["grad"] == max(out["grads"].values())
            assert any(name.startswith("experts.") for name in out["grads"])  # the sharded weights are checked


def test_slots_moonep_exact_ep_home_sums(results):
    for key, out in results[0].items():
        skew, kind = key
        assert out["target"] == 2 * 16 * 2  # 2 rows × 16 tokens a rank, tiny's top-2
        for res in results:  # every rank recorded the same plan
            assert res[key]["slots"] == out["slots"] and res[key]["replicas"] == out["replicas"]
        assert sum(out["slots"]) == sum(out["home_sums"]) == WORLD * out["target"]
        if kind == "moonep":
            assert out["slots"] == [out["target"]] * WORLD, (key, out["slots"])
            assert max(out["replicas"]) <= out["num_local"] == 4
        else:
            assert out["slots"] == out["home_sums"] and sum(out["replicas"]) == 0 and out["moved"] == 0
    one_home = results[0][("one_home", "moonep")]
    assert one_home["home_sums"] == [WORLD * one_home["target"], 0]  # plain EP: rank 0 computes everything
    assert one_home["replicas"] == [0, 1] and one_home["moved"] == one_home["target"]  # rank 1 borrows expert 0's weights
    assert len(set(results[0][("zipf", "ep")]["home_sums"])) > 1  # the skewed router is really unbalanced


def test_build_moe_rejects_unknown_skew():
    with pytest.raises(ValueError, match=r"skew='hot': allowed values are \('none', 'zipf', 'one_home'\)"):
        demos_expert.build_moe(skew="hot")
