"""kernels/predict_scaling.py: the prediction arithmetic by hand, config names, and a fake-process-group run of
the tiny preset on the CPU (in a subprocess, so this worker's torch.distributed state stays untouched)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from k3lab import testing

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "kernels" / "predict_scaling.py"


def load_script():
    return testing.load_script(SCRIPT, "predict_scaling")


def test_prediction_arithmetic_by_hand():
    ps = load_script()
    link = ps.Link("hand", alpha={k: 10e-6 for k in ps.KINDS}, busbw={k: 400e9 for k in ps.KINDS})
    comm = [dict(source="fsdp", kind="all_gather", n=8, bytes=1e9, calls=10),
            dict(source="fsdp", kind="reduce_scatter", n=8, bytes=0.5e9, calls=5),
            dict(source="ep", kind="all_to_all", n=8, bytes=0.8e9, calls=4),
            dict(source="other", kind="all_reduce", n=8, bytes=1e6, calls=2)]
    edges = [dict(kind="all_gather", n=8, bytes=0.1e9), dict(kind="reduce_scatter", n=8, bytes=0.05e9)]
    # by hand: t = calls·alpha + bytes·f/busbw, f = 7/8 (AG, RS, A2A), 2·7/8 (AR)
    ag = 10 * 10e-6 + 1e9 * 7 / 8 / 400e9            # 2.2875 ms
    rs = 5 * 10e-6 + 0.5e9 * 7 / 8 / 400e9           # 1.14375 ms
    a2a = 4 * 10e-6 + 0.8e9 * 7 / 8 / 400e9          # 1.79 ms
    ar = 2 * 10e-6 + 1e6 * 2 * 7 / 8 / 400e9         # 0.024375 ms
    assert ps.collective_seconds("all_gather", 1e9, 8, 10, link) == pytest.approx(2.2875e-3)
    assert ps.collective_seconds("all_reduce", 1e6, 8, 2, link) == pytest.approx(2.4375e-5)
    assert ps.collective_seconds("all_to_all", 1e9, 1, 3, link) == 0.0  # one rank: nothing moves
    total, fsdp = ag + rs + a2a + ar, ag + rs
    edge = (10e-6 + 0.1e9 * 7 / 8 / 400e9) + (10e-6 + 0.05e9 * 7 / 8 / 400e9)  # 0.348125 ms

    p = ps.predict_step(0.100, comm, link, edges)  # compute-bound: FSDP hides but its two edges
    assert p["comm"] == pytest.approx(5.245625e-3)
    assert p["no_overlap"] == pytest.approx(0.100 + total) and p["overlap"] == pytest.approx(0.100)
    assert p["blocking"] == pytest.approx(a2a + ar) and p["fsdp"] == pytest.approx(fsdp)
    assert p["realistic"] == pytest.approx(0.100 + a2a + ar + edge) == pytest.approx(0.1021625)

    p = ps.predict_step(0.001, comm, link, edges)  # comm-bound: FSDP's rest sticks out past the compute
    assert p["overlap"] == pytest.approx(total)
    assert p["realistic"] == pytest.approx(0.001 + (a2a + ar) + edge + (fsdp - edge - 0.001)) == pytest.approx(total)
    assert p["overlap"] <= p["realistic"] <= p["no_overlap"]


def test_link_models_from_the_peer_figures():
    ps = load_script()
    # the alpha-beta fit passes through §5's 4 MiB and 1 GiB points (time = bus bytes / busbw)
    for kind, points in ps.PEER_FIGURES_S5.items():
        alpha, beta = ps.fit_alpha_beta(points, kind)
        assert 0 < alpha < 1e-4 and 2e11 < beta < 4e11
        for mib in (4, 1024):
            bus = ps._bus_bytes_s5(kind, mib * 2 ** 20)
            assert alpha + bus / beta == pytest.approx(bus / (points[mib] * 1e9), rel=1e-9)
    assert ps.LINKS["nvlink8"].busbw["all_gather"] == 370e9
    assert ps.bus_factor("all_reduce", 8) == pytest.approx(1.75) and ps.bus_factor("all_gather", 2) == 0.5


def test_config_names():
    ps = load_script()
    spec = ps.parse_config("small-w8-ep8-16x1024@optimizer=sgd")
    assert (spec.preset, spec.world, spec.ep, spec.cp, spec.B, spec.T) == ("small", 8, 8, 1, 16, 1024)
    assert spec.option("optimizer") == "sgd" and spec.tokens_per_rank == 16 * 1024
    cp = ps.parse_config("small-w4-cp4-1x32768")
    assert cp.tokens_per_rank == 8192 and ps.baseline_of(cp).name == "small-w1-1x8192"
    k3 = ps.parse_config("k3slice-w8-ep8-2x4096@optimizer=sgd")
    base = ps.baseline_of(k3)
    assert base.world == 1 and base.option("experts_of_ep") == 8
    assert ps.model_config(base, local_experts=False).n_routed_experts == 896
    cfg = ps.model_config(ps.Spec("b", "k3slice", 1, 2, 4096, 8, 1, ()), local_experts=True)
    assert (cfg.n_routed_experts, cfg.num_hidden_layers, cfg.full_attn_layers, cfg.hidden_size) == (112, 2, [2], 7168)
    graphed = ps.parse_config("small-w8-16x1024@reshard=false,graph=true")
    assert graphed.option("graph") == "true" and ps.baseline_of(graphed).option("graph") == "true"  # graphed vs graphed
    assert ps.baseline_of(graphed).option("reshard") is None
    for names in ps.CONFIG_LISTS.values():
        for name in names:
            ps.parse_config(name)
    for bad in ("small-16x1024", "huge-w2-2x64", "tiny-w2-2x", "tiny-w3-ep2-2x64", "tiny-w2-2x64@optimizer=lion",
                "tiny-w2-2x64@graph=yes", "tiny-w2-ep2-2x64@lent=x"):
        with pytest.raises(ValueError):
            ps.parse_config(bad)


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("predict") / "rows.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--dtype", "float32", "--steps", "1", "--warmup", "1",
           "--configs", "tiny-w2-2x32", "tiny-w2-ep2-2x32@init=meta", "tiny-w2-2x32@reshard=false",
           "tiny-w4-ep4-2x32@ep_kind=static", "tiny-w4-ep4-2x32@ep_kind=static,lent=1",
           "tiny-w4-ep4-2x32@ep_kind=static,lent=1,send=bound", "tiny-w2-2x32@edges=units",
           "tiny-w2-2x32@edges=vocab",
           "--json", str(out),
           "--raise-errors"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    return rows, proc.stdout


def _by_source_kind(row):
    out = {}
    for c in row.get("comm", []):
        out[(c["source"], c["kind"])] = out.get((c["source"], c["kind"]), 0) + c["bytes"]
    return out


def _tiny_param_bytes(expert_parallel: bool):
    """(sublayer bytes, root bytes) of the tiny model's FSDP-managed fp32 parameters, from the model itself."""
    import torch

    from k3lab.config import ModelConfig
    from k3lab.model import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(ModelConfig.preset("tiny"))
    sub = root = 0
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias") or (expert_parallel and ".experts." in name):
            continue  # FSDP's ignored parameters
        in_sublayer = any(f".{s}." in name for s in ("self_attn", "mlp", "block_sparse_moe"))
        if in_sublayer:
            sub += 4 * p.numel()
        else:
            root += 4 * p.numel()
    return sub, root


def test_fake_pg_counts_fsdp_bytes(fake_run):
    rows, stdout = fake_run
    row = rows["tiny-w2-2x32"]
    assert row["finite"] and row["compute_ms"] > 0 and row["process_group"] == "fake"
    got = _by_source_kind(row)
    sub, root = _tiny_param_bytes(expert_parallel=False)
    # FSDP2: every sublayer all-gathered in forward and again in backward, the root once; one reduce-scatter
    assert got[("fsdp", "all_gather")] == pytest.approx(2 * sub + root, rel=0.03)
    assert got[("fsdp", "reduce_scatter")] == pytest.approx(sub + root, rel=0.03)
    assert got[("fsdp", "all_gather")] == pytest.approx(row["fsdp_expected"]["all_gather"], rel=1e-6)
    assert got[("fsdp", "reduce_scatter")] == pytest.approx(row["fsdp_expected"]["reduce_scatter"], rel=0.01)
    assert not any(kind == "all_to_all" for _, kind in got)  # no EP, no all-to-all
    assert row["uncounted_bytes"] == {}  # the dispatch-level count saw nothing the wrappers missed
    base = rows["tiny-w1-2x32"]
    assert base["world"] == 1 and base["compute_ms"] > 0 and "comm" not in base
    assert row["baseline"] == "tiny-w1-2x32" and row["compute_vs_one_gpu"] == pytest.approx(
        base["compute_ms"] / row["compute_ms"])
    p = row["predicted"]["nvlink8"]
    assert p["overlap"] <= p["realistic"] <= p["no_overlap"]
    # the edges nothing hides: the root's all-gather and reduce-scatter, the embedding and head inside (edges=root);
    # with edges=units the root's (its norms and AttnRes queries) and the embedding's, not the head's
    from k3lab.config import ModelConfig

    cfg = ModelConfig.preset("tiny")
    table = 4 * cfg.vocab_size * cfg.hidden_size                   # the embedding's (= the head's) fp32 bytes
    edges = [(e["kind"], e["bytes"]) for e in row["fsdp_edges"]]
    assert [k for k, _ in edges] == ["all_gather", "reduce_scatter"] and edges[0][1] >= root, edges
    edges = [(e["kind"], e["bytes"]) for e in rows["tiny-w2-2x32@edges=units"]["fsdp_edges"]]
    assert [k for k, _ in edges] == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"], edges
    rest = root - 2 * table                                          # the root's own (each parameter padded)
    assert [b for _, b in edges] == pytest.approx([rest, table, rest, table], rel=0.4)
    assert edges[1][1] == edges[3][1] == pytest.approx(table, rel=1e-3)  # (the final callback: root, then embedding)
    assert _by_source_kind(rows["tiny-w2-2x32@edges=units"]) == pytest.approx(got, rel=1e-3)  # the same bytes
    assert "| tiny-w2-2x32 | 2 | 64 |" in stdout  # the table, printed last
    kept = rows["tiny-w2-2x32@reshard=false"]  # ParallelOptions.reshard_after_forward=False: no backward re-gather
    got = _by_source_kind(kept)
    assert got[("fsdp", "all_gather")] == pytest.approx(sub + root, rel=0.03)
    assert got[("fsdp", "all_gather")] == pytest.approx(kept["fsdp_expected"]["all_gather"], rel=1e-6)
    assert got[("fsdp", "reduce_scatter")] == pytest.approx(sub + root, rel=0.03)


def test_the_fake_groups_writes_are_counted_and_taken_out_of_the_rank_compute(fake_run):
    """The fake group writes each collective's output on the compute stream (a real group's NCCL kernels write it on
    their own): the counting step records those bytes, an all-gather's whole output and a reduce-scatter's one chunk of
    its input, none for an all-reduce; they are timed on their own (``emulation_ms``), and the prediction's compute is
    the measured compute less that time."""
    ps = load_script()
    rows, stdout = fake_run
    for name in ("tiny-w2-2x32", "tiny-w2-ep2-2x32@init=meta"):
        row = rows[name]
        by_kind = {}
        for c in row["comm"]:
            by_kind[c["kind"]] = by_kind.get(c["kind"], 0) + c["bytes"]
        writes = row["emulation_writes"]
        assert writes["all_gather"] == by_kind["all_gather"]            # nccl-tests size: the gathered output
        assert writes["reduce_scatter"] == by_kind["reduce_scatter"] / 2  # the input, of which this rank gets 1/2
        assert "all_reduce" not in writes and by_kind["all_reduce"] > 0   # in place: the fake group writes nothing
        assert writes.get("all_to_all", 0) == by_kind.get("all_to_all", 0)  # equal splits: the buffers match
        assert 0 < row["emulation_ms"] < row["compute_ms"]
        link = ps.LINKS["nvlink8"]
        alone = ps.predict_step((row["compute_ms"] - row["emulation_ms"]) / 1e3, row["comm"], link, row["fsdp_edges"])
        assert row["predicted"]["nvlink8"]["realistic"] == pytest.approx(1e3 * alone["realistic"], rel=1e-12)
        gross = ps.predict_step(row["compute_ms"] / 1e3, row["comm"], link, row["fsdp_edges"])
        assert gross["realistic"] > alone["realistic"]
        assert f"| {name} | 2 | 64 | {row['compute_ms']:.1f} | {row['emulation_ms']:.1f} |" in stdout
    assert "emulation_ms" not in rows["tiny-w1-2x32"]  # one GPU: no collective, nothing to take out
    import torch

    assert ps.emulation_seconds([], torch.device("cpu")) == 0.0  # nothing written, nothing to time


def test_the_sharded_lookup_moves_tokens_not_the_table(fake_run):
    """edges=vocab: FSDP2 moves the table no more (its all-gathers and reduce-scatters are the other rows'
    less one table each), and the lookup's exchanges, blocking, carry R·N token ids and R·N rows of D each way;
    the step's exposed FSDP calls are the root's alone (the head a unit of its own)."""
    from k3lab.config import ModelConfig

    rows, _ = fake_run
    cfg = ModelConfig.preset("tiny")
    table, R, N, D = 4 * cfg.vocab_size * cfg.hidden_size, 2, 2 * 32, cfg.hidden_size
    plain, got = _by_source_kind(rows["tiny-w2-2x32"]), _by_source_kind(rows["tiny-w2-2x32@edges=vocab"])
    assert got[("fsdp", "all_gather")] == pytest.approx(plain[("fsdp", "all_gather")] - table, rel=1e-3)
    assert got[("fsdp", "reduce_scatter")] == pytest.approx(plain[("fsdp", "reduce_scatter")] - table, rel=1e-3)
    ids, rows_fp32 = 8 * R * N, 4 * R * N * D
    assert got[("other", "all_gather")] - plain.get(("other", "all_gather"), 0) == ids + rows_fp32
    assert got[("other", "reduce_scatter")] - plain.get(("other", "reduce_scatter"), 0) == rows_fp32
    edges = rows["tiny-w2-2x32@edges=vocab"]["fsdp_edges"]
    assert [e["kind"] for e in edges] == ["all_gather", "reduce_scatter"] and max(e["bytes"] for e in edges) < table


def test_fake_pg_counts_ep_all_to_all(fake_run):
    rows, _ = fake_run
    row = rows["tiny-w2-ep2-2x32@init=meta"]
    assert row["finite"] and row["uncounted_bytes"] == {}
    got = _by_source_kind(row)
    assert got[("ep", "all_to_all")] > 0
    # every MoE layer: the tokens out and back in forward, and both again in backward, at least
    # S·K rows of the latent width L in fp32 each way
    from k3lab.config import ModelConfig

    cfg = ModelConfig.preset("tiny")
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    tokens = 2 * 32
    assert got[("ep", "all_to_all")] >= 4 * moe_layers * tokens * cfg.num_experts_per_tok * cfg.routed_expert_hidden_size * 4
    sub, root = _tiny_param_bytes(expert_parallel=True)  # the expert slices are EP's, not FSDP's
    assert got[("fsdp", "all_gather")] == pytest.approx(2 * sub + root, rel=0.03)
    assert math.isfinite(row["predicted"]["nvlink8"]["realistic"])


def test_fake_pg_counts_the_fixed_shape_exchange(fake_run):
    """ep_kind=static (k3lab.parallel.expert_static) on a fake rank of 4: per MoE layer the rows go out and back as
    fixed [S·K, L] buffers and the replica weights as one fixed [E/R, 3·I·L] buffer (padded to a multiple of R), in
    forward and again in backward: exactly those bytes, every one seen by the dispatch-level count too."""
    from k3lab.config import ModelConfig
    from k3lab.moe.latent import LatentMoE

    rows, _ = fake_run
    row = rows["tiny-w4-ep4-2x32@ep_kind=static"]
    assert row["finite"] and row["uncounted_bytes"] == {}
    cfg = ModelConfig.preset("tiny")
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    w1 = LatentMoE(cfg).experts.w1                                                    # [E, I, L]
    El, R = cfg.n_routed_experts // 4, 4
    rows_bytes = 2 * 32 * cfg.num_experts_per_tok * w1.shape[2] * 4                    # [S·K, L] fp32
    weight_numel = El * 3 * w1.shape[1] * w1.shape[2]
    weight_bytes = (weight_numel + (-weight_numel) % R) * 4
    assert _by_source_kind(row)[("ep", "all_to_all")] == moe_layers * (4 * rows_bytes + 2 * weight_bytes)
    # lent=1: the weight exchanges move one expert's weights each way (a rank borrowing one expert), the rows as before
    lent = rows["tiny-w4-ep4-2x32@ep_kind=static,lent=1"]
    one = 3 * w1.shape[1] * w1.shape[2]
    assert lent["finite"] and lent["uncounted_bytes"] == {}
    assert _by_source_kind(lent)[("ep", "all_to_all")] == moe_layers * (4 * rows_bytes + 2 * (one + (-one) % R) * 4)
    # send=bound: the exchange handed the whole send buffer (El + R − 2 rows) moves the same row, so the same bytes
    # and the same losses; only the copies into the buffer (and the gradient's index-add) differ
    bound = rows["tiny-w4-ep4-2x32@ep_kind=static,lent=1,send=bound"]
    assert _by_source_kind(bound) == _by_source_kind(lent) and bound["losses"] == lent["losses"]


def test_host_profile_attributes_time_by_package():
    """--host-profile: a step that spends its host time in k3lab's Python and in a C++ op is attributed to those
    two buckets, and its top functions name the k3lab function."""
    import torch

    from k3lab.residual import attn_res

    ps = load_script()
    assert ps.host_bucket("/x/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py") == \
        "FSDP2 hooks and copies"
    assert ps.host_bucket("/x/site-packages/torch/distributed/tensor/_dispatch.py") == "DTensor dispatch"
    assert ps.host_bucket("~") == "C++ (ops, launches, backward engine)"
    assert ps.allocator_counts(torch.device("cpu")) == {}  # the allocator's counters are CUDA's
    proj, norm = torch.nn.Linear(8, 1, bias=False), torch.nn.RMSNorm(8)
    sources = [torch.randn(4, 8) for _ in range(3)]
    a, b = torch.randn(300, 300), torch.randn(300, 300)

    def step():
        for _ in range(200):
            attn_res(sources, proj, norm)
        for _ in range(20):
            a @ b

    prof = ps.host_profile_step(step, torch.device("cpu"), top=50)
    assert prof["wall_ms"] >= sum(prof["buckets"].values()) * 0.9
    assert prof["buckets"]["k3lab"] > 0 and prof["buckets"]["C++ (ops, launches, backward engine)"] > 0
    assert any("attn_res" in name and calls == 200 for name, calls, _ in prof["top"]), prof["top"]


def test_lent_is_refused_where_it_sizes_nothing():
    """lent= sizes the static MoonEP dispatcher's replica-weight exchange: refused by name without it, or above the
    E/ep experts a rank can borrow."""
    ps = load_script()
    args = ps.build_parser().parse_args(["--device", "cpu", "--dtype", "float32", "--steps", "1", "--warmup", "1"])
    with pytest.raises(ValueError, match="lent= sizes MoonEP's replica-weight exchange: it needs ep_kind=static"):
        ps.run_config(ps.parse_config("tiny-w2-ep2-2x32@lent=1"), args, process_group="fake")
    with pytest.raises(ValueError, match="send= says what the lent=N exchange is handed: it needs lent="):
        ps.run_config(ps.parse_config("tiny-w4-ep4-2x32@ep_kind=static,send=bound"), args, process_group="fake")
    with pytest.raises(ValueError, match=r"lent=99: a rank borrows 0 to E/ep = \d+ experts"):
        ps.run_config(ps.parse_config("tiny-w2-ep2-2x32@ep_kind=static,lent=99"), args, process_group="fake")


def test_graphed_config_is_refused_where_it_cannot_run():
    """graph=true on a CPU, or with a host-planned EP dispatcher (host-read all-to-all sizes), is refused by name,
    not run eager."""
    ps = load_script()
    args = ps.build_parser().parse_args(["--device", "cpu", "--dtype", "float32", "--steps", "1", "--warmup", "1"])
    with pytest.raises(ValueError, match="graph=true needs a CUDA device, no CP, and with EP ep_kind=static"):
        ps.run_config(ps.parse_config("tiny-w1-2x32@graph=true"), args, process_group="none")


@pytest.mark.gpu
def test_graphed_sharded_step_equals_the_eager_one(tmp_path):
    """A fake-group FSDP rank (N = 2, fp32) replaying forward + backward + norm as a CUDA graph computes the eager
    rank's losses step by step (same seed, same batch): the capture records FSDP2's all-gathers and reduce-scatters,
    and the eager update writes into the captured gradients."""
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cuda", "--dtype", "float32", "--steps", "3", "--warmup", "2",
           "--no-baseline", "--configs", "tiny-w2-2x64@reshard=false", "tiny-w2-2x64@reshard=false,graph=true",
           "tiny-w1-2x64", "tiny-w1-2x64@graph=true", "--json", str(out), "--raise-errors"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    for eager, graphed in (("tiny-w2-2x64@reshard=false", "tiny-w2-2x64@reshard=false,graph=true"),
                           ("tiny-w1-2x64", "tiny-w1-2x64@graph=true")):
        assert rows[graphed]["graphed"] is True
        a, b = rows[eager]["losses"], rows[graphed]["losses"]  # step by step; the graphed run has one more (the capture)
        assert len(b) == len(a) + 1 >= 6 and b[-1] < b[0]  # the replayed steps train: the loss falls
        assert b[:len(a)] == pytest.approx(a, rel=1e-4), (eager, a, b)


@pytest.mark.gpu
def test_graphed_static_moonep_rank_equals_its_eager_step(tmp_path):
    """A fake-group FSDP + MoonEP rank (N = 2, EP = 2, fp32) with the fixed-shape dispatcher
    (k3lab.parallel.expert_static; no host read) captures: replayed as a CUDA graph it computes the eager rank's
    losses step by step, with the weight exchange handed the whole send buffer or (``lent=1``) only the row it reads;
    the host-planned dispatcher's graph=true is refused by name."""
    out = tmp_path / "rows.json"
    pairs = [(f"tiny-w2-ep2-2x64@ep_kind=static,reshard=false{lent}",
              f"tiny-w2-ep2-2x64@ep_kind=static,reshard=false{lent},graph=true") for lent in ("", ",lent=1")]
    cmd = [sys.executable, str(SCRIPT), "--device", "cuda", "--dtype", "float32", "--steps", "3", "--warmup", "2",
           "--no-baseline", "--configs", *[c for pair in pairs for c in pair], "--json", str(out), "--raise-errors"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    for eager, graphed in pairs:
        assert rows[graphed]["graphed"] is True
        a, b = rows[eager]["losses"], rows[graphed]["losses"]
        assert len(b) == len(a) + 1 >= 6 and b[-1] < b[0]
        assert b[:len(a)] == pytest.approx(a, rel=1e-4), (eager, a, b)
    bad = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--steps", "1", "--warmup", "1", "--no-baseline",
                          "--configs", "tiny-w2-ep2-2x64@graph=true", "--raise-errors"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "ep_kind=static" in bad.stdout + bad.stderr


@pytest.mark.gpu
def test_the_fake_writes_are_timed_without_the_hosts_launches():
    """``emulation_seconds`` times the copies alone: it equals the same copies captured in a CUDA graph and replayed
    (no host between them): within 15% for a few large copies, within 30% for many small ones, where timing the
    host's launches (several µs each, against about 1 µs of copying) would come out two to four times longer."""
    import torch

    ps = load_script()
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    for sizes, rel in (([3 << 28, 1 << 26, 5 << 20], 0.15), ([1 << 20] * 200, 0.30)):
        got = ps.emulation_seconds(sizes, dev, repeats=5)
        room = min(max(sizes), 1 << 28)
        src, dst = torch.ones(room, dtype=torch.uint8, device=dev), torch.empty(room, dtype=torch.uint8, device=dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for size in sizes:
                for start in range(0, size, room):
                    k = min(room, size - start)
                    dst[:k].copy_(src[:k])
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        ref = sorted(times)[2]
        assert got == pytest.approx(ref, rel=rel), (len(sizes), got, ref)


@pytest.mark.gpu
def test_emulated_exchange_takes_its_modelled_time_and_moves_the_stand_ins_rows():
    """``emulated_exchange``: each call returns what the stand-in exchange returns (this rank's rows, on the fake
    group) and holds the caller's stream at least the step model's time for that all-to-all, forward and backward;
    work on another stream is not held."""
    import torch

    ps = load_script()
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    link = ps.LINKS["nvlink8"]
    exchange = ps.emulated_exchange(link)
    dev = torch.device("cuda")
    with ps.fake_rank(8, 0, dev):
        x = torch.randn(4096, 512, device=dev, requires_grad=True)
        want = ps.collective_seconds("all_to_all", x.numel() * 4, 8, 1, link)  # ~0.1 ms: fp32 rows, no padding
        exchange(x.detach(), None, None, 4096, None)  # compile the timer kernels
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y = exchange(x, None, None, 4096, None)
        end.record()
        y.backward(torch.ones_like(y))
        torch.cuda.synchronize()
        assert start.elapsed_time(end) >= 1e3 * want * 0.999, (start.elapsed_time(end), want)
        assert torch.equal(y, ps.fixed_size_exchange(x.detach(), None, None, 4096, None))
        assert torch.equal(x.grad, torch.ones_like(x))
        # with row orders (a placing exchange): the same rows as the stand-in's, forward and backward
        take, place = (torch.randperm(4096, device=dev) for _ in range(2))
        orders = dict(take=(take, take.argsort()), place=(place, place.argsort()))
        g = torch.randn(4096, 512, device=dev)
        got = [ex(x, None, None, 4096, None, **orders) for ex in (exchange, ps.fixed_size_exchange)]
        grads = [torch.autograd.grad(y, x, g)[0] for y in got]
        assert torch.equal(got[0], got[1]) and torch.equal(got[1], x.detach()[take][place])
        assert torch.equal(grads[0], grads[1]) and torch.equal(grads[1][take][place], g)


def test_the_stand_ins_row_orders_equal_the_dispatchers_own_gathers():
    """The stand-in exchange places the received rows bank-major and takes them back from that order itself (as a
    two-dimensional all-to-all writes them); wrapped by ``unplaced`` it leaves both to the dispatcher's gathers. A
    static MoonEP layer on rank 0 of a 4-rank fake group gives the same output and gradients either way (exactly: the
    same rows, gathered in another place), and the orders are real permutations (the rows are not already bank-major,
    so a wrong order would show)."""
    import torch
    import torch.distributed as dist

    from k3lab.config import ModelConfig
    from k3lab.moe.latent import LatentMoE
    from k3lab.parallel.expert import apply_expert_parallel
    from k3lab.parallel.expert_static import apply_static_moonep

    ps = load_script()
    cfg = ModelConfig.preset("tiny").replace(n_routed_experts=8, num_experts_per_tok=2)
    assert ps.fixed_size_exchange.places_rows and not getattr(ps.unplaced(ps.fixed_size_exchange), "places_rows", 0)
    assert ps.unplaced(ps.fixed_size_exchange).capturable
    orders = []  # the row orders the dispatcher hands the placing exchange (one place, one take a forward)

    def recording(x, send, recv, rows_out, group, take=None, place=None):
        orders.extend(o[0] for o in (take, place) if o is not None)
        return ps.fixed_size_exchange(x, send, recv, rows_out, group, take, place)

    recording.capturable = recording.places_rows = True
    results = {}
    with ps.fake_rank(4, 0, torch.device("cpu")):
        for name, exchange in (("placed", recording), ("unplaced", ps.unplaced(ps.fixed_size_exchange))):
            torch.manual_seed(0)
            moe = apply_static_moonep(apply_expert_parallel(LatentMoE(cfg), None), None, exchange)
            x = torch.randn(2, 32, cfg.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
            y = moe(x)
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)))
            results[name] = (y.detach(), x.grad, moe.experts.w1.grad, moe.experts.w2.grad)
    for want, got in zip(results["unplaced"], results["placed"]):
        assert torch.equal(want, got)
    assert len(orders) == 2 and all(not torch.equal(o, torch.arange(len(o))) for o in orders), orders


def test_the_emulated_exchange_refuses_the_cpu_by_name():
    import torch

    ps = load_script()
    with ps.fake_rank(2, 0, torch.device("cpu")), pytest.raises(ValueError, match="emulated_exchange: its timer runs "
                                                                                   "on a CUDA GPU"):
        ps.emulated_exchange(ps.LINKS["nvlink8"])(torch.ones(4, 2), None, None, 4, None)


def test_a_rank_with_the_emulated_exchange_adds_the_other_collectives_only():
    """bench_train's prediction for a fake rank whose ms already holds its all-to-alls (``exchange=emulated``):
    the same step model without the all-to-all records, their modelled time reported apart."""
    bench = testing.load_script(ROOT / "kernels" / "bench_train.py", "bench_train")
    ps = load_script()
    link = ps.LINKS["nvlink8"]
    a2a = dict(source="other", kind="all_to_all", n=8, bytes=8e9, calls=90)
    rest = [dict(source="fsdp", kind="all_gather", n=8, bytes=3e8, calls=33),
            dict(source="other", kind="all_reduce", n=8, bytes=8e6, calls=36)]
    edges = [dict(kind="all_gather", n=8, bytes=2e7)]
    counted = dict(comm=[*rest, a2a], fsdp_edges=edges)
    inside = bench.predicted_step(200.0, counted, in_compute=("all_to_all",))
    blocking = bench.predicted_step(200.0, counted)
    alone = ps.predict_step(0.2, rest, link, edges)
    assert inside["predicted_ms"] == pytest.approx(1e3 * alone["realistic"])
    assert inside["in_compute_ms"] == pytest.approx(1e3 * ps.collective_seconds("all_to_all", 8e9, 8, 90, link))
    assert blocking["predicted_ms"] == pytest.approx(inside["predicted_ms"] + inside["in_compute_ms"])
    # the fake group's writes leave the compute, except those inside the emulated all-to-alls' own time
    counted["fake_writes_ms"] = {"all_gather": 3.0, "all_to_all": 5.0}
    less = bench.predicted_step(200.0, counted, in_compute=("all_to_all",))
    assert less["fake_writes_ms"] == 3.0
    assert less["predicted_ms"] == pytest.approx(1e3 * ps.predict_step(0.197, rest, link, edges)["realistic"])
    assert bench.predicted_step(200.0, counted)["predicted_ms"] == pytest.approx(blocking["predicted_ms"] - 8.0)
