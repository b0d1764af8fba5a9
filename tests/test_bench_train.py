"""kernels/bench_train.py: config names, the table, and a CPU run at a tiny size (the benchmark itself is for a GPU)."""

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3lab.testing import load_script

BENCH = Path(__file__).resolve().parents[1] / "kernels" / "bench_train.py"


def load_bench():
    return load_script(BENCH, "bench_train")


def test_config_names():
    bench = load_bench()
    assert bench.parse_config("small-16x1024") == bench.Spec("small-16x1024", "small", 16, 1024)
    assert bench.parse_config("fla-kda-anchor-8x4096").model == "fla-kda-anchor"
    for name in bench.DEFAULT_CONFIGS:
        bench.parse_config(name)
    for bad in ("small", "huge-2x64", "tiny-0x64", "tiny-2x"):
        with pytest.raises(ValueError, match="must be MODEL-BxT"):
            bench.parse_config(bad)
    spec = bench.parse_config("small-16x1024@compile=sublayer,recompute=selective")
    assert (spec.model, spec.B, spec.T) == ("small", 16, 1024)
    assert spec.option("recompute", "none") == "selective" and spec.option("fused_loss", "off") == "off"
    with pytest.raises(ValueError, match=r"option 'recompute=all': allowed values are \('none', 'selective', 'mixer', "
                                         r"'sublayer'\)"):  # TrainConfig's own check and its allowed values
        bench.parse_config("small-16x1024@recompute=all")
    spec = bench.parse_config("kda-anchor-8x4096@recompute=mixer,recompute_layers=16")
    assert spec.option("recompute", "none") == "mixer" and spec.option("recompute_layers", None) == "16"
    with pytest.raises(ValueError, match=r"option 'recompute_layers=half': 'half' is not an int"):
        bench.parse_config("small-16x1024@recompute=sublayer,recompute_layers=half")
    with pytest.raises(ValueError, match=r"option 'recompute_layers=-1': must be None \(all layers\) or an int >= 0"):
        bench.parse_config("small-16x1024@recompute=sublayer,recompute_layers=-1")
    with pytest.raises(ValueError, match=r"option 'recompute_layers=4': needs TrainConfig.recompute in"):
        bench.parse_config("small-16x1024@recompute_layers=4")  # a combination: TrainConfig's own rule
    with pytest.raises(ValueError, match=r"option 'lr_max=1': the keys are TrainConfig's fields \(lr, .*via=fit\|cli"):
        bench.parse_config("small-16x1024@lr_max=1")
    for skipped in ("steps=3", "out_dir=x"):  # not settings of a benchmark (TRAIN_SKIP)
        with pytest.raises(ValueError, match="the keys are TrainConfig's fields"):
            bench.parse_config(f"small-16x1024@{skipped}")
    with pytest.raises(ValueError, match=r"option 'via=both': allowed values are fit\|cli"):
        bench.parse_config("tiny-2x8@via=both")
    spec = bench.parse_config("tiny-2x8@cuda_graph=on,master_format=split,param_dtype=bfloat16,betas=0.8/0.9,lr=2e-3")
    assert spec.train_options() == dict(cuda_graph=True, master_format="split", param_dtype="bfloat16",
                                        betas=(0.8, 0.9), lr=2e-3)


def test_param_dtype_option():
    bench = load_bench()
    spec = bench.parse_config("tiny-2x8@param_dtype=bfloat16,fused_loss=on")
    assert spec.option("param_dtype", "float32") == "bfloat16" and spec.option("fused_loss", "off") == "on"
    with pytest.raises(ValueError, match=r"option 'param_dtype=float16': allowed values are \('float32', 'bfloat16'\)"):
        bench.parse_config("tiny-2x8@param_dtype=float16")


@pytest.mark.parametrize("argv, where", [
    (["--configs", "tiny-2x8@param_dtype=bfloat16"], "error: config 'tiny-2x8@param_dtype=bfloat16': option 'param_dtype=bfloat16': "),
    (["--configs", "tiny-2x8", "--param-dtype", "bfloat16"], "error: --param-dtype: ")])
def test_bf16_params_need_bf16_autocast(argv, where, capsys):
    """TrainConfig's own rule, before any child starts; the error names the per-config option or the flag."""
    with pytest.raises(SystemExit) as exit_:
        load_bench().main(argv + ["--dtype", "float32", "--device", "cpu"])
    assert exit_.value.code == 2
    assert where + "needs TrainConfig.dtype='bfloat16' (bf16 autocast), got TrainConfig.dtype='float32'" \
        in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--lr", "-1"], "error: --lr: must be a finite number > 0"),
    (["--recompute", "all"], "error: argument --recompute: invalid choice: 'all'"),
    (["--warmup-steps", "9"], "error: --warmup-steps: must be None or an int in [0, steps=5]"),  # 1 + 1 + 3 steps
    (["--moment-dtype", "bfloat16"], "error: --moment-dtype: 'bfloat16' needs TrainConfig.param_dtype='bfloat16'")])
def test_bad_training_flags_end_as_argparse_does(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_bench().main(["--configs", "tiny-2x8", "--device", "cpu", "--steps", "3", "--warmup", "1"] + argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def _train_fields():
    import dataclasses

    from k3lab.train import TrainConfig

    return {f.name for f in dataclasses.fields(TrainConfig) if f.init}


def load_profile():
    return load_script(BENCH.parent / "profile_train_step.py", "profile_train_step")


@pytest.mark.parametrize("load", [load_bench, load_profile], ids=["bench_train", "profile_train_step"])
def test_every_train_config_field_is_a_flag(load):
    """One home for each knob: every TrainConfig field but the script's documented TRAIN_SKIP is a flag of its
    parser, generated by k3lab.cli (its allowed values TrainConfig.CHOICES'), so a new field is a flag there."""
    from k3lab.cli import flag_name
    from k3lab.train import TrainConfig

    script = load()
    parser = script.build_parser()
    assert set(script.TRAIN_SKIP) <= _train_fields(), "TRAIN_SKIP names a field TrainConfig no longer has"
    by_flag = parser._option_string_actions
    for name in sorted(_train_fields() - set(script.TRAIN_SKIP)):
        assert flag_name(name) in by_flag, f"TrainConfig.{name} is not a flag of {script.__name__} (nor in its TRAIN_SKIP)"
        action = by_flag[flag_name(name)]
        assert action.dest == name and action.choices == TrainConfig.CHOICES.get(name, action.choices), name


def test_child_gets_every_training_setting():
    """The child process's command carries every TrainConfig setting of the command line (k3lab.cli.flags_for):
    parsed back by the same parser, the same TrainConfig."""
    bench = load_bench()
    parser = bench.build_parser()
    args = parser.parse_args(["--configs", "tiny-2x8", "--device", "cpu", "--dtype", "bfloat16", "--param-dtype",
                              "bfloat16", "--master-format", "split", "--cuda-graph", "--fused-loss", "--lr", "0.002",
                              "--betas", "0.8", "0.9", "--recompute", "mixer", "--recompute-layers", "3",
                              "--optimizer-kwargs", '{"eps": 1e-06}', "--seed", "7", "--warmup-steps", "none"])
    cmd = bench.child_command("tiny-2x8", "row.json", args)
    assert cmd[2:4] == ["--child", "tiny-2x8"]
    child = parser.parse_args(cmd[2:])
    assert bench.train_settings(child) == bench.train_settings(args)
    assert set(bench.train_settings(args)) == _train_fields() - set(bench.TRAIN_SKIP) | {"steps", "progress"}


def test_run_config_bf16_params_and_fused_loss_through_train_config():
    """One config in this process (no child): bf16 weights with fp32 masters and the fused loss, via TrainConfig."""
    bench = load_bench()
    args = bench.build_parser().parse_args(["--device", "cpu", "--dtype", "bfloat16", "--steps", "1", "--warmup", "0"])
    row = bench.run_config(bench.parse_config("tiny-1x8@param_dtype=bfloat16,fused_loss=on"), args)
    assert row["status"] == "ok", row["status"]
    assert row["weights"] == "bfloat16 (fp32 master)" and row["fused_loss"] == "on"
    assert math.isfinite(row["loss"]) and row["steps_timed"] == 1
    assert "| bfloat16 (fp32 master) |" in bench.markdown_table([row])


def test_fit_as_a_fake_rank():
    """@via=fake-rank: fit as rank 0 of a fake group of 2 (FSDP alone, the predictor's fills), the rank holding B × T
    tokens of a 2·B-row global batch: it trains (the fake all-reduce does not sum, so the logged loss is the rank's
    share, about ln V / 2 at the start), and ranks= / reshard= without it are refused by name."""
    bench = load_bench()
    args = bench.build_parser().parse_args(["--device", "cpu", "--dtype", "float32", "--steps", "2", "--warmup", "1"])
    row = bench.run_config(bench.parse_config("tiny-2x32@via=fake-rank,ranks=2,reshard=false"), args)
    assert row["status"] == "ok", row["status"]
    assert row["via"] == "fake rank of 2, reshard=false" and row["tokens_per_step"] == 64 and row["steps_timed"] == 2
    assert 0.4 * math.log(4096) < row["loss_first"] < 0.6 * math.log(4096) and math.isfinite(row["loss"])
    one = dict(config="tiny-2x32@via=fit", via="fit", tokens_per_s=200.0, losses=[8.3], peak_mem_gib=1.0)
    kinds = {r["kind"]: r["bytes"] for r in row["counted"]["comm"] if r["source"] == "fsdp"}
    assert kinds["all_gather"] > 0 and kinds["reduce_scatter"] > 0
    # the fake group's writes of the counted step, timed apart, leave the compute; the collectives' model comes in
    writes = row["counted"]["fake_writes_ms"]
    assert set(writes) == {"all_gather", "reduce_scatter"} and row["fake_writes_ms"] == sum(writes.values()) > 0
    assert row["predicted_ms"] == bench.predicted_step(row["ms_per_step"], row["counted"])["predicted_ms"]
    assert row["predicted_ms"] > row["ms_per_step"] - row["fake_writes_ms"]
    per_gpu = 64 / (row["predicted_ms"] / 1e3)
    assert bench.via_comparison([one, row]) == [
        f"tiny-2x32: fit as a fake rank of 2, reshard=false ÷ fit on one GPU: tokens/s per GPU "
        f"{row['tokens_per_s'] / 200:.3f}× (the rank's compute; its collectives are free in the fake group: "
        "kernels/predict_scaling.py adds them)",
        f"tiny-2x32: the same rank with its counted collectives on nvlink8 (kernels/predict_scaling.py's step model: "
        f"{row['comm_ms']:.1f} ms of them, {row['predicted_ms']:.1f} ms predicted): {per_gpu:,.0f} tokens/s per GPU, "
        f"{per_gpu / 200:.3f}× fit on one GPU"]
    for bad in ("tiny-2x32@ranks=2", "tiny-2x32@via=fit,reshard=false", "tiny-2x32@ep=2"):
        with pytest.raises(ValueError, match="options ranks=, reshard=, ep=, ep_plan=, exchange=, overlap=, chunks=, "
                                             "placed=, edges= need via=fake-rank"):
            bench.parse_config(bad)
    for bad in ("tiny-2x32@via=fake-rank,placed=false", "tiny-2x32@via=fake-rank,ep=2,ep_plan=host,placed=true"):
        with pytest.raises(ValueError, match="option 'placed=' needs ep=2|4|8 and ep_plan=device"):
            bench.parse_config(bad)
    for bad in ("tiny-2x32@via=fake-rank,exchange=emulated", "tiny-2x32@via=fake-rank,ep=2,exchange=emulated"):
        with pytest.raises(ValueError, match="option 'exchange=emulated' needs ep=2|4|8 and ep_plan=device"):
            bench.parse_config(bad)
    with pytest.raises(ValueError, match=r"option 'ranks=3': allowed values are 2\|4\|8"):
        bench.parse_config("tiny-2x32@via=fake-rank,ranks=3")


def test_fit_as_a_fake_rank_with_each_edges_layout():
    """@via=fake-rank,edges=units|vocab: the rank trains with the embedding and head in units of their own, or the
    table sharded by rows; the row names the layout, and the counted exposed FSDP calls follow it
    (``exposed_calls``: the root's and the embedding's for ``units``, the root's only for ``vocab``, whose lookup's
    all-gathers and reduce-scatters are counted as blocking collectives)."""
    bench = load_bench()
    args = bench.build_parser().parse_args(["--device", "cpu", "--dtype", "float32", "--steps", "2", "--warmup", "1"])
    rows = {edges: bench.run_config(bench.parse_config(f"tiny-2x32@via=fake-rank,ranks=2,reshard=false{opt}"), args)
            for edges, opt in (("root", ""), ("units", ",edges=units"), ("vocab", ",edges=vocab"))}
    for edges, row in rows.items():
        assert row["status"] == "ok", (edges, row["status"])
        assert row["via"] == "fake rank of 2, reshard=false" + ("" if edges == "root" else f", edges={edges}")
    calls = {edges: len(row["counted"]["fsdp_edges"]) for edges, row in rows.items()}
    assert calls == {"root": 2, "units": 4, "vocab": 2}, calls
    fsdp_bytes = {e: sum(r["bytes"] for r in row["counted"]["comm"] if r["source"] == "fsdp")
                  for e, row in rows.items()}
    assert fsdp_bytes["vocab"] < fsdp_bytes["root"] == fsdp_bytes["units"], fsdp_bytes  # the table leaves FSDP
    edge_bytes = {e: sum(c["bytes"] for c in row["counted"]["fsdp_edges"]) for e, row in rows.items()}
    assert edge_bytes["vocab"] < edge_bytes["units"] < edge_bytes["root"], edge_bytes  # vocab: the root's alone
    lookup = {r["kind"] for r in rows["vocab"]["counted"]["comm"]
              if r["source"] == "other" and r["kind"] != "all_reduce"}
    assert lookup == {"all_gather", "reduce_scatter"}, lookup  # the lookup's exchanges, blocking in the step model


def test_fit_as_a_fake_expert_parallel_rank_with_either_plan():
    """@via=fake-rank,ep=2: fit's MoonEP rank (every rank routes like this one), planned on the host or on the device
    (``ParallelOptions.ep_plan``): the same plan over the same weights and batches, so the same losses (fp32, float
    rounding of a different row order), and the row names the plan."""
    bench = load_bench()
    args = bench.build_parser().parse_args(["--device", "cpu", "--dtype", "float32", "--steps", "2", "--warmup", "1"])
    rows = [bench.run_config(bench.parse_config(f"tiny-2x32@via=fake-rank,ranks=2,ep=2,ep_plan={plan}"), args)
            for plan in ("host", "device")]
    for row, plan in zip(rows, ("host", "device")):
        assert row["status"] == "ok", row["status"]
        assert row["via"] == f"fake rank of 2, EP = 2, {plan}-planned MoonEP"
    host, device = (r["losses"] for r in rows)
    assert len(host) == 4 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(host, device)), (host, device)
    a2a = [sum(r["bytes"] for r in row["counted"]["comm"] if r["kind"] == "all_to_all") for row in rows]
    assert a2a[0] == a2a[1] > 0  # the EP exchanges counted (blocking in the step model), the same bytes either plan
    graphed, eager = SimpleNamespace(cuda_graph=True), SimpleNamespace(cuda_graph=False)  # the stand-in: graphs only
    spec = bench.parse_config("tiny-2x32@via=fake-rank,ranks=2,ep=2,ep_plan=device")
    assert bench.uses_stand_in(spec, graphed) and not bench.uses_stand_in(spec, eager)
    assert not bench.uses_stand_in(bench.parse_config("tiny-2x32@via=fake-rank,ranks=2,ep=2"), graphed)


def test_anchor_config_is_pure_kda_dense():
    cfg = load_bench().k3lab_config("kda-anchor")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim, cfg.vocab_size) == \
        (24, 1024, 8, 128, 32000)
    assert cfg.full_attn_layers == [] and cfg.residual == "prenorm" and cfg.intermediate_size == 2816
    assert all(cfg.mlp_kind_at(i) == "dense" for i in range(24))


def test_table_reports_oom_and_skips():
    bench = load_bench()
    rows = [dict(config="small-8x4096", model="k3lab", compile="none", status="OOM", peak_mem_gib=134.4),
            dict(config="fla-kda-anchor-8x4096", model="fla", status="skipped: fla's kernels need CUDA")]
    table = bench.markdown_table(rows).splitlines()
    assert len(table) == 4 and table[0].count("|") == table[1].count("|") == table[2].count("|")
    assert table[2].endswith("| OOM |") and "134.4" in table[2] and "skipped" in table[3]


@pytest.mark.slow  # two child processes (~40 s on 2 cores); config parsing and the table are tested above
def test_cpu_run_writes_finite_rows(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--configs", "tiny-2x64@recompute=sublayer",
                           "fla-kda-anchor-2x64", "--steps", "2", "--warmup", "1", "--dtype", "float32",
                           "--fused-loss", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["peak_flops"] == 790e12 and "H200" in report["peak_source"]
    tiny, fla = report["rows"]
    assert tiny["status"] == "ok" and tiny["steps_timed"] == 2 and tiny["recompute"] == "sublayer"
    for key in ("ms_per_step", "tokens_per_s", "mfu", "peak_mem_gib", "first_step_s", "loss"):
        assert isinstance(tiny[key], float) and math.isfinite(tiny[key]) and tiny[key] > 0, key
    assert fla["status"].startswith("skipped") and "ms_per_step" not in fla
    lines = proc.stdout.strip().splitlines()
    assert lines[-2].startswith("| tiny-2x64 | k3lab") and lines[-1].startswith("| fla-kda-anchor-2x64 | fla")


def test_torch_profile_adds_one_untimed_profiled_step():
    """``--torch-profile TOP``: fit runs one more step, which is profiled (its top ops by host time: the model's
    matmuls among them) and left out of the timing; without it, no profile and no extra step."""
    bench = load_bench()
    for top in (0, 30):
        args = bench.build_parser().parse_args(["--device", "cpu", "--dtype", "float32", "--steps", "2", "--warmup", "1",
                                                "--torch-profile", str(top)])
        row = bench.run_config(bench.parse_config("tiny-2x32"), args)
        assert row["status"] == "ok" and row["steps_timed"] == 2
        assert len(row["losses"]) == 1 + 1 + 2 + (1 if top else 0)
        if not top:
            assert "profile" not in row
            continue
        prof = row["profile"]
        assert prof["wall_ms"] > 0 and 0 < len(prof["top_host"]) <= top
        assert any(name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear") for name, _, _ in prof["top_host"])
