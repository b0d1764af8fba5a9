"""kernels/bench_kda.py's ``--launch`` overrides (pure Python: the benchmark itself needs an H200)."""

import importlib.util
from pathlib import Path

import pytest

from k3lab.kernels import kda

BENCH = Path(__file__).resolve().parents[1] / "kernels" / "bench_kda.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_kda", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_launch_override_merges_into_the_named_entries():
    bench = load_bench()
    launch = {name: dict(cfg) for name, cfg in kda.LAUNCH.items()}
    bench.override_launch(launch, '{"bwd_state": {"num_stages": 2, "BV": [32, 16]}, '
                                  '"bwd_intra": {"diag_precision": "tf32"}}')
    assert launch["bwd_state"] == dict(kda.LAUNCH["bwd_state"], num_stages=2, BV=(32, 16))
    assert launch["bwd_intra"] == dict(kda.LAUNCH["bwd_intra"], diag_precision="tf32")
    assert launch["fwd_gate"] == kda.LAUNCH["fwd_gate"]


@pytest.mark.parametrize("text", ['{"bwd_stat": {"num_stages": 2}}',
                                  '{"fwd_gate": {"BK": 16}, "bwd_state": {"stages": 2}}'],
                         ids=["unknown_kernel", "unknown_key_after_a_valid_entry"])
def test_launch_override_refuses_unknown_names(text):
    bench = load_bench()
    launch = {name: dict(cfg) for name, cfg in kda.LAUNCH.items()}
    with pytest.raises(SystemExit, match="--launch: unknown kernel or key"):
        bench.override_launch(launch, text)
    assert launch == kda.LAUNCH
