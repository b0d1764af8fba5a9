"""kernels/bench_train.py: config names, the table, and a CPU run at a tiny size (the benchmark itself is for a GPU)."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "kernels" / "bench_train.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_train", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


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
    with pytest.raises(ValueError, match="option 'recompute=all'.*recompute=none|selective|sublayer"):
        bench.parse_config("small-16x1024@recompute=all")
    spec = bench.parse_config("kda-anchor-8x4096@recompute=mixer,recompute_layers=16")
    assert spec.option("recompute", "none") == "mixer" and spec.option("recompute_layers", None) == "16"
    with pytest.raises(ValueError, match=r"option 'recompute_layers=half'.*recompute_layers=N \(an int >= 0\)"):
        bench.parse_config("small-16x1024@recompute=sublayer,recompute_layers=half")


def test_param_dtype_option():
    bench = load_bench()
    spec = bench.parse_config("tiny-2x8@param_dtype=bfloat16,fused_loss=on")
    assert spec.option("param_dtype", "float32") == "bfloat16" and spec.option("fused_loss", "off") == "on"
    with pytest.raises(ValueError, match="option 'param_dtype=float16'.*param_dtype=float32|bfloat16"):
        bench.parse_config("tiny-2x8@param_dtype=float16")


@pytest.mark.parametrize("argv", [["--configs", "tiny-2x8@param_dtype=bfloat16"],
                                  ["--configs", "tiny-2x8", "--param-dtype", "bfloat16"]])
def test_bf16_params_need_bf16_autocast(argv, capsys):
    with pytest.raises(SystemExit):
        load_bench().main(argv + ["--dtype", "float32", "--device", "cpu"])
    assert "param_dtype='bfloat16' needs --dtype bfloat16" in capsys.readouterr().err


def test_run_config_bf16_params_and_fused_loss_through_train_config():
    """One config in this process (no child): bf16 weights with fp32 masters and the fused loss, via TrainConfig."""
    import argparse

    bench = load_bench()
    args = argparse.Namespace(device="cpu", dtype="bfloat16", param_dtype="float32", moment_dtype="float32", optimizer="adamw", compile="none",
                              recompute="none", fused_loss=False, steps=1, warmup=0, peak_flops=bench.PEAK_FLOPS,
                              fla_weights="bfloat16")
    row = bench.run_config(bench.parse_config("tiny-1x8@param_dtype=bfloat16,fused_loss=on"), args)
    assert row["status"] == "ok", row["status"]
    assert row["weights"] == "bfloat16 (fp32 master)" and row["fused_loss"] == "on"
    assert math.isfinite(row["loss"]) and row["steps_timed"] == 1
    assert "| bfloat16 (fp32 master) |" in bench.markdown_table([row])


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
