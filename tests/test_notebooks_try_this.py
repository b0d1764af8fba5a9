"""The notebooks' "Try this" suggestions, run: each applies the suggested change through papermill parameters and
the notebook's own asserts check the outcome its sentence predicts."""
from pathlib import Path

import papermill
import pytest


def _run(tmp_path, name: str, **parameters):
    out = tmp_path / f"{name}.ipynb"
    notebooks = Path(__file__).resolve().parent.parent / "notebooks"
    papermill.execute_notebook(str(notebooks / f"{name}.ipynb"), str(out), parameters=parameters,
                               kernel_name="python3", progress_bar=False, cwd=str(notebooks))
    return out


def test_notebook_12_plain_ep_gives_unequal_slots():
    """Notebook 12: "set ep_kind = 'ep': the losses stay the same, but the slots_per_rank lists of that run become
    unequal" — the notebook's cells with ep_kind = "ep", its launch loop restricted to the world-1 reference and the
    world-4 run the sentence is about (the world-2 run does not use ep_kind), then its slots cell. The notebook's
    asserts check the losses against one process (1e-5) and, for a plain-EP run, unequal slots."""
    name, marker = "12_scaling_up", "from k3lab.parallel.launch import launch"
    ns = _cells(name, stop=marker, ep_kind="ep")
    loop = _changed_cell(name, marker, 'layouts = [(1, []), (world_size, ["--ep", str(ep), "--cp", str(cp)]), ',
                         "layouts = [(1, []), ")
    exec(compile(loop, f"{name}.ipynb §2 launches, world 1 and 4", "exec"), ns)
    said = "slots per EP rank, first MoE layer"
    slots = _changed_cell(name, said, said, said)  # the cell as it is
    exec(compile(slots, f"{name}.ipynb §2 slots", "exec"), ns)
    run = ns["runs"]["world 4 (ep 2, cp 2, ep)"]
    assert run["ep_kind"] == "ep" and not all(len(set(s)) == 1 for s in run["slots_per_rank"]), run["slots_per_rank"]


def _prefix_line(nb_path, index_of_cell) -> dict:
    """Notebook 13 §3's printed numbers: token hit rate, entries, bytes."""
    import json
    import re

    cell = json.loads(Path(nb_path).read_text())["cells"][index_of_cell]
    text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
    rate = float(re.search(r"token hit rate ([\d.]+)", text).group(1))
    entries, size = re.search(r"entries (\d+), ([\d,]+) bytes", text).groups()
    return dict(rate=rate, entries=int(entries), bytes=int(size.replace(",", "")))


def _cell_index(nb_path, marker: str) -> int:
    import json

    cells = json.loads(Path(nb_path).read_text())["cells"]
    return next(i for i, c in enumerate(cells) if c["cell_type"] == "code" and marker in "".join(c["source"]))


def test_notebook_13_smaller_blocks_same_hit_rate_more_bytes(tmp_path):
    """Notebook 13: "set block_tokens = 16 and doc_blocks = 32: the token hit rate stays (0.81), the cache holds more
    than 4x as many entries and about 3.6x the bytes" — against the committed run at the default parameters."""
    committed = Path(__file__).resolve().parent.parent / "notebooks" / "13_inference.ipynb"
    marker = "pc = PrefixCache(model, block_tokens=block_tokens)"
    base = _prefix_line(committed, _cell_index(committed, marker))
    out = _run(tmp_path, "13_inference", block_tokens=16, doc_blocks=32)
    small = _prefix_line(out, _cell_index(out, marker))
    assert small["rate"] == base["rate"] == 0.81
    assert small["entries"] > 4 * base["entries"]
    assert 3.3 < small["bytes"] / base["bytes"] < 3.9, (small, base)


# --- notebooks 00, 02, 03, 04, 08, 09, 10, 11 -------------------------------------------------------------------
# Where the change is a parameter of a cheap section, the test runs the notebook's own code cells (up to a marker)
# in this process with the parameter changed, so the notebook's asserts run too; where the sentence is about a
# k3lab function called with other arguments (an explorer setting), it calls that function; whole-notebook runs
# that take longer than ~30 s go through papermill and are marked slow.

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _cells(name: str, stop: str | None = None, **parameters) -> dict:
    """Execute notebook ``name``'s code cells in order in a fresh namespace, with ``parameters`` applied right after
    the cell tagged ``parameters`` (as papermill injects them), stopping before the first code cell whose source
    contains ``stop``. Figures go to the Agg backend. Returns the namespace."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    cells = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))["cells"]
    ns: dict = {"__name__": "__main__"}
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        if stop is not None and stop in source:
            return ns
        exec(compile(source, f"{name}.ipynb cell {i}", "exec"), ns)
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            ns.update(parameters)
    assert stop is None, f"{name}: no code cell contains {stop!r}"
    return ns


def _outputs(nb_path) -> str:
    """All printed text of an executed notebook."""
    import json

    cells = json.loads(Path(nb_path).read_text(encoding="utf-8"))["cells"]
    return "".join("".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c.get("outputs", []))


def test_notebook_00_mqa_counterfactual():
    """Notebook 00: "set gqa_kv_heads = 1 ... all-GQA's cache per token falls 8x, from 380,928 B to 47,616 B, below
    all-MLA's 107,136 B, yet K3 still has the smallest cache at 1M tokens; all-GQA's decode and prefill FLOPs barely
    change (4,965 -> 4,962 GFLOP a token, 2,693 -> 2,690 PFLOP at 1M)"."""
    from k3lab.config import ModelConfig
    from k3lab.costs import InferenceCosts

    k3, N = ModelConfig.preset("k3"), 1048576
    gqa8, gqa1 = (InferenceCosts(k3, "all_gqa", gqa_kv_heads=h, gqa_head_dim=128) for h in (8, 1))
    mla, ours = InferenceCosts(k3, "all_mla"), InferenceCosts(k3, "k3")
    assert (gqa8.cache_bytes_per_token(), gqa1.cache_bytes_per_token()) == (380_928, 47_616)
    assert gqa1.cache_bytes_per_token() < mla.cache_bytes_per_token() == 107_136
    assert ours.cache_bytes_per_token() == 27_648
    assert ours.cache_bytes(N) < gqa1.cache_bytes(N) < mla.cache_bytes(N)
    for key in ("decode_flops", "prefill_flops"):
        before, after = getattr(gqa8, key)(N), getattr(gqa1, key)(N)
        assert after < before and (before - after) / before < 0.002, (key, before, after)  # falls, but barely
    assert round(gqa8.decode_flops(N) / 1e9) == 4965 and round(gqa1.decode_flops(N) / 1e9) == 4962
    assert round(gqa8.prefill_flops(N) / 1e15) == 2693 and round(gqa1.prefill_flops(N) / 1e15) == 2690


@pytest.mark.slow
def test_notebook_02_weaker_gate_bound(tmp_path):
    """Notebook 02: "set gate_lower_bound = -1.0 ... every check still passes, the errors stay at the same levels,
    and §3's table shows that with g >= -1 even a whole 64-token chunk (exponent 63) would fit" — papermill (the
    Triton interpreter makes it ~40 s)."""
    import re

    base = _outputs(NOTEBOOKS / "02_kda_chunkwise_and_triton.ipynb")
    out = _outputs(_run(tmp_path, "02_kda_chunkwise_and_triton", gate_lower_bound=-1.0))
    row = re.search(r"g >= +-1\.0: exponent +([\d ]+)\n", out)
    assert row and row.group(1).split() == ["3", "7", "15", "31", "63"], out
    assert 63 < 88.7
    pattern = r"^(o|final state|dq|dk|dv|dg|dbeta|dh0) +rel\. error vs float64 reference: ([\d.e+-]+)$"
    errs = lambda text: {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}
    before, after = errs(base), errs(out)
    assert set(after) == set(before) and len(after) == 8
    assert all(after[k] < 1e-4 and after[k] < 10 * before[k] for k in after), (before, after)  # same level


def test_notebook_03_deeper_bound_needs_smaller_tiles():
    """Notebook 03: "set g_min = -10 and keep 16-token tiles: the worst-case exponent is 160; at s = 4 the sampled
    gates reach about 91 and all but 0.05% of the rows come out finite, at s = 8 (about 123) around 6% are inf/NaN.
    Then tile_size = 8: the worst case is 80 again and no row breaks at any s" — tiles_at_bound's computation."""
    import torch

    from k3lab.config import ModelConfig
    from k3lab.experiments.numerics import factored_errors, sample_log_decay
    from k3lab.mixers.kda import l2norm

    batch, seq_len, H, seed = 2, 256, 8, 0  # the notebook's defaults
    K = ModelConfig.preset("tiny").kda_head_dim
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(batch, seq_len, H, K, generator=gen)) * K ** -0.5
    k = l2norm(torch.randn(batch, seq_len, H, K, generator=gen))
    v = torch.randn(batch, seq_len, H, K, generator=gen)

    def bf16(tile, s):
        g = sample_log_decay("k3", (batch, seq_len, H, K), s, generator=torch.Generator().manual_seed(seed),
                             lower_bound=-10.0)
        r = factored_errors(q, k, v, g, tile, (torch.bfloat16,))[torch.bfloat16]
        return -r["min_tile_log_decay"], r["nonfinite_rows"]

    assert 16 * 10 == 160 and 8 * 10 == 80
    reach4, broken4 = bf16(16, 4.0)
    reach8, broken8 = bf16(16, 8.0)
    assert 88.7 < reach4 < 93 and 0 < broken4 < 0.001, (reach4, broken4)
    assert 120 < reach8 < 126 and 0.05 < broken8 < 0.08, (reach8, broken8)
    for s in (0.5, 1.0, 2.0, 4.0, 8.0):  # the explorer's scales
        reach, broken = bf16(8, s)
        assert reach < 80 and broken == 0, (s, reach, broken)


def test_notebook_04_layer_mix_at_1m():
    """Notebook 04: "at 1M tokens 7:1 (12 MLA layers) needs about half of K3's 29.4 GB, 1:1 (47 MLA layers) about
    twice; at 4,096 tokens the order reverses (6 MiB of fixed state a KDA layer)" — the explorer's mix_costs."""
    ns = _cells("04_gated_mla_and_kv_cache", stop="contexts = [min_context")  # §1-§4, not the timed §5
    mix_costs = ns["mix_costs"]
    (k3, n3), (seven, n7), (one, n1) = (mix_costs(m) for m in ("3:1 (K3)", "7:1", "1:1"))
    assert (n3, n7, n1) == (24, 12, 47)
    M, short = 1048576, 4096
    assert round(k3.cache_bytes(M) / 1e9, 1) == 29.4
    assert 0.45 < seven.cache_bytes(M) / k3.cache_bytes(M) < 0.55
    assert 1.85 < one.cache_bytes(M) / k3.cache_bytes(M) < 2.05
    assert seven.cache_bytes(short) > k3.cache_bytes(short) > one.cache_bytes(short)
    assert 6.0 < (k3.cache_fixed_bytes() / (93 - n3)) / 2 ** 20 < 6.5


def test_notebook_08_skewed_and_flat_routers():
    """Notebook 08: explorer at skew 2.0 and 0.0 (the numbers of its Try this) — simulate_balancing, the loop the
    explorer's load_history repeats (the notebook asserts that)."""
    from k3lab.experiments.moe_simulate import simulate_balancing

    runs = {"none": dict(balancer="none"), "aux": dict(balancer="aux_loss", aux_lr=0.1),
            "loss-free": dict(balancer="loss_free", gamma=1e-3), "QB": dict(balancer="quantile_hist")}
    sim = lambda skew, kw: simulate_balancing(n=64, k=4, m=4096, steps=30, skew=skew, drift=0.01, seed=0, **kw)
    hot = {name: sim(2.0, kw) for name, kw in runs.items()}
    assert all(14.9 < v[0] <= 15 for v in hot.values())  # 16x the fair share: the most top-4 of 64 allows
    assert hot["QB"][1] < 1 and max(hot["QB"][2:]) < 0.5
    assert min(hot["loss-free"]) > 14.5
    assert hot["aux"][-1] > 6
    flat = {name: sim(0.0, kw) for name, kw in runs.items()}
    assert all(abs(v[0] - 0.17) < 0.01 for v in flat.values())
    assert flat["none"][-1] > 2 and flat["loss-free"][-1] > 1 and max(flat["QB"]) < 0.3


@pytest.mark.slow
def test_notebook_09_three_times_the_training(tmp_path):
    """Notebook 09: "set steps = 60: every validation loss drops (by about half a nat), Muon's lead over AdamW grows
    and stays far larger than the seed spread, and the MoE-vs-dense gap stays inside it" — papermill (~90 s)."""
    import re

    def table(text):
        val = {name: float(v) for name, v in re.findall(
            r"^(K3 · Muon|K3 · AdamW|dense · Muon) +[\d.]+ ± [\d.]+ +([\d.]+) ± [\d.]+", text, re.M)}
        verdict = {name: (float(gap), word, float(spread)) for name, gap, word, spread in re.findall(
            r"^(Muon vs AdamW|MoE vs dense) ?: .*?better by ([\d.]+), the gap (exceeds|is within)[^(]*\(([\d.]+)\)",
            text, re.M)}
        return val, verdict

    base_val, base_verdict = table(_outputs(NOTEBOOKS / "09_train_tiny_k3.ipynb"))
    val, verdict = table(_outputs(_run(tmp_path, "09_train_tiny_k3", steps=60)))
    assert set(val) == set(base_val) == {"K3 · Muon", "K3 · AdamW", "dense · Muon"}
    assert all(0.3 < base_val[k] - val[k] < 0.8 for k in val), (base_val, val)
    gap, word, spread = verdict["Muon vs AdamW"]
    assert word == "exceeds" and gap > base_verdict["Muon vs AdamW"][0] and gap > 2 * spread, verdict
    assert verdict["MoE vs dense"][1] == "is within", verdict


def test_notebook_10_hotter_experts():
    """Notebook 10: "set zipf_a = 2.0: plain EP's Zipf bars spread further (busiest rank at R = 8 from about 1.3x to
    about 1.4x the mean, and the §2 table rises at every R), MoonEP stays at exactly 1.000, every assert passes, and
    Zipf routing needs only a replica or two per rank" — the notebook's §1-§3 cells (its asserts included)."""
    stop = "demo = run_ranks("  # §4 spawns processes: not needed here
    base = _cells("10_expert_parallel", stop=stop)
    hot = _cells("10_expert_parallel", stop=stop, zipf_a=2.0)
    assert 1.25 < base["ep_ratio"]["Zipf"] < 1.35 and 1.35 <= hot["ep_ratio"]["Zipf"] < 1.45, (base["ep_ratio"], hot["ep_ratio"])
    for R in hot["ranks_grid"]:
        assert hot["grid"][R, "Zipf"]["ep"] > base["grid"][R, "Zipf"]["ep"], R
        assert hot["grid"][R, "Zipf"]["moon"] == 1.0 and hot["grid"][R, "Zipf"]["rep"] <= 2
        assert hot["grid"][R, "Zipf"]["rep"] < hot["grid"][R, "Zipf"]["bound"]


def test_notebook_10_reach_the_bound():
    """Notebook 10: "set num_experts = 128 and ranks_grid = [2, 4, 8, 16]: at R = 16 the idle-home case needs
    ceil(128*15/256) = 8 replicas on one rank, the E/R bound; plain EP's one-home case computes 16x the mean; at R = 2
    the count falls a little below the formula (30 against 32)" — the notebook's §1-§3 cells."""
    ns = _cells("10_expert_parallel", stop="demo = run_ranks(", num_experts=128, ranks_grid=[2, 4, 8, 16])
    grid = ns["grid"]
    assert grid[16, "idle home"]["tight"] == 8 == grid[16, "idle home"]["bound"] == grid[16, "idle home"]["rep"]
    assert grid[16, "one home"]["ep"] == 16
    assert (grid[2, "idle home"]["rep"], grid[2, "idle home"]["tight"]) == (30, 32)


def test_notebook_11_short_memory_one_process():
    """Notebook 11, first Try this, §1: "set g_min = -5.0: max ||M||_2 drops to ~0, max ||S_in|| shrinks, yet the
    error without S_in stays at several percent" — the notebook's §1 cells (its asserts included)."""
    import torch

    def section1(**params):
        ns = _cells("11_context_parallel", stop="sizes = sorted(set(cp_sizes)", **params)
        Tp, parts, o_ref = ns["Tp"], ns["parts"], ns["o_ref"]
        M = max(torch.linalg.matrix_norm(m[3], 2).max().item() for m in ns["maps"])
        S_in, S = 0.0, torch.zeros_like(ns["maps"][0][2])
        for m in ns["maps"][:-1]:
            S = m[3] @ S + m[2]
            S_in = max(S_in, torch.linalg.matrix_norm(S).max().item())
        no_fold = [ns["demos"].max_err(m[0], o_ref[:, p * Tp:(p + 1) * Tp]) for p, m in enumerate(ns["maps"])][1:]
        return M, S_in, min(no_fold)

    long_M, long_S, _ = section1()
    short_M, short_S, short_no_fold = section1(g_min=-5.0)
    assert long_M > 1e-2 and short_M < 1e-30, (long_M, short_M)
    assert short_S < long_S / 2, (short_S, long_S)
    assert short_no_fold > 0.02, short_no_fold


def _cp_row(text: str, cp: int, layout: str) -> tuple[float, float]:
    """Notebook 11 §2: the (mix o, mix gradients) errors of one CP size and layout."""
    import re

    row = re.search(rf"^ *{cp} {layout} +\| +([\d.e+-]+) +([\d.e+-]+)", text, re.M)
    assert row, (cp, layout)
    return float(row.group(1)), float(row.group(2))


@pytest.mark.slow
def test_notebook_11_short_memory_across_processes(tmp_path):
    """Notebook 11, first Try this, §2: "set g_min = -5.0: the errors stay inside the asserted bounds, but the CP = 4
    zigzag row of the mix rises to ~1e-6 (output) and ~1e-5 (gradients)" — papermill (~60 s, process spawns)."""
    base = _cp_row(_outputs(NOTEBOOKS / "11_context_parallel.ipynb"), 4, "zigzag")
    o, grad = _cp_row(_outputs(_run(tmp_path, "11_context_parallel", g_min=-5.0)), 4, "zigzag")
    assert o > base[0] and grad > base[1], (base, (o, grad))
    assert 3e-7 < o < 5e-6 and 3e-6 < grad < 5e-5, (o, grad)  # ~1e-6 and ~1e-5, inside the asserts (1e-5, 1e-4)


@pytest.mark.slow
def test_notebook_11_zigzag_everywhere(tmp_path):
    """Notebook 11, second Try this: "set layout = "zigzag": §3's KDA bytes double while the MLA latent bytes stay the
    same, so the crossover T doubles; the §4 losses still match" (the notebook asserts the losses) — papermill."""
    import re

    def section3(text):
        rows = {int(T): (int(kda.replace(",", "")), int(mla.replace(",", "")))
                for T, kda, mla in re.findall(r"^ *(\d+) +\d+ \| +([\d,]+) +([\d,]+) ", text, re.M)}
        cross = float(re.search(r"passes it above T ≈ ([\d,]+) tokens", text).group(1).replace(",", ""))
        return rows, cross

    base_rows, base_cross = section3(_outputs(NOTEBOOKS / "11_context_parallel.ipynb"))
    rows, cross = section3(_outputs(_run(tmp_path, "11_context_parallel", layout="zigzag")))
    assert rows.keys() == base_rows.keys() and len(rows) == 6
    assert all(rows[T][0] == 2 * base_rows[T][0] and rows[T][1] == base_rows[T][1] for T in rows), (base_rows, rows)
    assert abs(cross - 2 * base_cross) <= 2, (base_cross, cross)


# --- notebooks 07, 14 -------------------------------------------------------------------------------------------

def test_notebook_07_situ_at_the_low_learning_rate(monkeypatch):
    """Notebook 07: "set stress_lr = 3e-3: SwiGLU's largest GLU output stays under 5 in every seed, close to SiTU's
    (both far under the bound of 100 and FP8's 448), so the SITU-3 verdict drops to 'not reproduced at this scale'"
    — the notebook's §1-§4 cells (its asserts included). steps=2 only shortens §3's MoE runs, which §4 does not use
    (every run reseeds; §4's numbers are the same as with steps=30)."""
    import re

    # the notebook's first cell sets TRITON_INTERPRET=1 in this process; setenv records the variable (present or not)
    # so that teardown puts it back — delenv(raising=False) on an absent variable records nothing, and the "1" leaked
    # into later tests of this worker (test_precision saw the fused kernel "run" on a CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ns = _cells("07_latent_moe_and_situ", stop="from k3lab.kernels.moe_rows import combine_rows",
                stress_lr=3e-3, steps=2)
    peak, seeds = ns["peak"], ns["seeds"]
    assert len(peak["swiglu"]) == len(peak["situ"]) == len(seeds) == 3
    assert all(v < 5 for v in peak["swiglu"]) and all(v < 5 for v in peak["situ"]), peak
    assert all(abs(a - b) < 0.5 for a, b in zip(peak["swiglu"], peak["situ"])), peak  # close, seed by seed
    verdict = ns["situ_vs_swiglu_peak"]
    assert verdict["status"] == "not reproduced at this scale" and not verdict["confirmed"], verdict
    # the contrast the sentence draws: at the default stress_lr (3e-2) the committed run confirms SITU-3
    committed = re.search(r"^largest \|h\|: SiTU [\d.]+ ± [\d.]+ vs SwiGLU ([\d.]+) ± [\d.]+ .*the gap exceeds",
                          _outputs(NOTEBOOKS / "07_latent_moe_and_situ.ipynb"), re.M)
    assert committed and float(committed.group(1)) > 100, committed


def test_notebook_14_one_qb_update():
    """Notebook 14: "run with qb_steps = 1: the held-out busiest expert's share falls from the no-bias value to about
    the value printed above 'after its first update', and the four updates after it gain less than a fifth of what the
    first one did" — the notebook's §1-§4 cells (the course model's checkpoint), against the committed run's printed
    shares (2.39x, 1.29x, 1.17x)."""
    import re

    committed = re.search(r"busiest expert got ([\d.]+)× its share; .*? after (\d+) updates on the other half gives "
                          r"([\d.]+)× \(([\d.]+)× after its first update",
                          _outputs(NOTEBOOKS / "14_real_k3_weights.ipynb"))
    assert committed and committed.group(2) == "5", committed
    no_bias, five, first = (float(committed.group(i)) for i in (1, 3, 4))
    ns = _cells("14_real_k3_weights", stop="axes[0].hist(scores", qb_steps=1)
    ns["tmp"].cleanup()
    one = ns["viol"]["QB bias (1 updates)"] + 1
    assert f"{ns['viol']['no bias'] + 1:.2f}" == f"{no_bias:.2f}"
    assert f"{one:.2f}" == f"{first:.2f}", (one, first)  # about the "after its first update" value
    assert one < no_bias - 0.1, (one, no_bias)  # falls from the no-bias value
    assert 0 <= one - five < 0.2 * (no_bias - one), (one, five, no_bias)  # the next four gain < 1/5 of the first's


# --- notebooks 01, 05, 06 ---------------------------------------------------------------------------------------


def _changed_cell(name: str, marker: str, old: str, new: str) -> str:
    """The source of notebook ``name``'s first code cell containing ``marker``, with ``old`` replaced by ``new``."""
    import json

    cells = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))["cells"]
    source = next("".join(c["source"]) for c in cells if c["cell_type"] == "code" and marker in "".join(c["source"]))
    assert source.count(old) == 1, (name, old)
    return source.replace(old, new)


def test_notebook_06_random_pseudo_query_is_nearly_one_hot(monkeypatch):
    """Notebook 06: "replace nn.init.zeros_(proj.weight) by nn.init.normal_(proj.weight, std=3.0): the assert fails;
    at every position one source takes most of the weight (above 0.7 at every position, above 0.999 at four of the
    six), and h is no longer the mean of the sources" — the notebook's §1 cell with that one line changed."""
    import torch

    from k3lab.testing import rel_err

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the notebook's first cell sets it to "1"; teardown restores it
    marker = "nn.init.zeros_(proj.weight)"
    ns = _cells("06_attention_residuals", stop=marker)
    changed = _changed_cell("06_attention_residuals", marker, marker, "nn.init.normal_(proj.weight, std=3.0)")
    with pytest.raises(AssertionError):  # the cell's assert (uniform weights, h = mean) fails
        exec(compile(changed, "06_attention_residuals.ipynb §1, changed", "exec"), ns)
    p, h, sources = ns["p"], ns["h"], ns["sources"]
    top = p.reshape(p.shape[0], -1).max(0).values  # the largest weight at each of the 2 x 3 positions
    assert top.numel() == 6 and (top > 0.7).all(), top
    assert int((top > 0.999).sum()) == 4, top
    assert rel_err(h, torch.stack(sources).mean(0)) > 0.1


def test_notebook_05_evaluate_to_64x():
    """Notebook 05: "run with max_multiple=64 (rows of up to 1,024 tokens; evaluation only): all-MLA (NoPE) still
    retrieves at every length, the hybrids keep falling with the needle's distance, and the per-position loss of
    neither hybrid blows up past train_len" — the notebook's cells through its training loop, which trains (and
    evaluates at 1x-64x) only the three variants the sentence names, at the first seed."""
    import numpy as np

    name = "05_nope_vs_rope"
    ns = _cells(name, stop="variants = {", max_multiple=64)
    named = ("hybrid NoPE (K3)", "hybrid RoPE", "all-MLA (NoPE)")
    loop = _changed_cell(name, "variants = {", "jobs = seed_major(hybrids, seed_list) + [(name, seed) for name in others]",
                         f"jobs = [(name, seed) for name in {named!r}]")
    exec(compile(loop, f"{name}.ipynb §2 training loop, three variants", "exec"), ns)
    T, multiples = ns["train_len"], ns["multiples"]
    assert multiples[-1] == 64
    acc = {n: ns["results"][n, 0]["acc"] for n in named}
    assert all(acc["all-MLA (NoPE)"][m] >= 0.8 for m in multiples), acc  # chance is 0.1
    for n in named[:2]:
        assert acc[n][64] < acc[n][32] < acc[n][16] < acc[n][1], (n, acc[n])
        curve = ns["results"][n, 0]["curve"]
        edges = [0] + [m * T for m in multiples]
        bins = [float(np.nanmean(curve[a:b])) for a, b in zip(edges[:-1], edges[1:])]
        assert max(bins) - bins[0] < 0.1, (n, bins)  # no blow-up past train_len (bins[0] is [0, train_len))


@pytest.mark.slow
def test_notebook_01_five_seeds():
    """Notebook 01: "run with seeds=5: the means can move by more than a tenth (KDA 0.692 -> 0.560, Gated DeltaNet
    0.534 -> 0.470) and the half-ranges grow rather than shrink (0.115 -> 0.241 and 0.154 -> 0.175); the verdict at
    this scale stays the one printed above" — the notebook's cells with the two compared mixers only (the lineage
    table's other mixers do not enter part 4), against the same run's first three seeds (~60 s)."""
    from k3lab.experiments.nb import compare_seeds, mean_spread

    ns = _cells("01_linear_attention_lineage", stop="# What we found, computed from the results above", seeds=5,
                mixers=["gated_deltanet", "kda"])
    assert ns["seeds_done"] == [0, 1, 2, 3, 4], ns["seeds_done"]
    five = ns["mean_recall"]
    expected = {"kda": ((0.692, 0.115), (0.560, 0.241)), "gated_deltanet": ((0.534, 0.154), (0.470, 0.175))}
    for m, (at3, at5) in expected.items():
        got3, got5 = mean_spread(five[m][:3]), mean_spread(five[m])
        assert got5[1] >= got3[1]
        assert all(abs(a - b) < 0.02 for a, b in zip(got3 + got5, at3 + at5)), (m, got3, got5)
    v3 = compare_seeds("KDA", five["kda"][:3], "Gated DeltaNet", five["gated_deltanet"][:3])
    v5 = ns["verdicts"]["gated_deltanet"]
    assert v3["status"] == v5["status"] == "not reproduced at this scale", (v3, v5)


def test_notebook_01_twice_the_steps():
    """Notebook 01: "then try steps=400: both mixers recall more and the capacity effect (recall falling with the pair
    count) becomes clearer than the differences between the mixers" — KDA and Gated DeltaNet trained with the
    notebook's own configuration at its first seed for 400 steps, against the committed 200-step table (seed 0)."""
    import re

    from k3lab.experiments.mqar import train_mqar

    table = _outputs(NOTEBOOKS / "01_linear_attention_lineage.ipynb")
    at200 = {m: [float(a) for a in re.search(rf"^{m} +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) ", table, re.M).groups()]
             for m in ("kda", "gated_deltanet")}
    ns = _cells("01_linear_attention_lineage", stop="seed_list = list(range(seed, seed + seeds))", mixers=[])
    pairs = tuple(ns["run"]["pairs_grid"])
    assert pairs == (1, 2, 4, 8) and ns["config"]["steps"] == 200
    at400 = {m: list(train_mqar(m, pairs, seed=0, **{**ns["config"], "steps": 400})["accuracy"].values())
             for m in at200}
    mean = lambda acc: sum(acc) / len(acc)  # noqa: E731
    for m in at200:
        assert mean(at400[m]) > mean(at200[m]) + 0.1, (m, at200[m], at400[m])  # recalls more
    for at in (at200, at400):  # the capacity effect: recall falls with the pair count, for both mixers
        assert all(acc[-1] < acc[0] for acc in at.values()), at
    gap200, gap400 = (abs(mean(at["kda"]) - mean(at["gated_deltanet"])) for at in (at200, at400))
    drop200, drop400 = (min(acc[0] - acc[-1] for acc in at.values()) for at in (at200, at400))
    assert drop400 > 3 * gap400 and drop400 / gap400 > drop200 / gap200, (at200, at400)  # clearer than the mixers' gap
