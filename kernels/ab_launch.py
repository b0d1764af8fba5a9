"""A/B timing of k3lab's Triton KDA under several ``LAUNCH`` variants, in one process on one GPU.

    python kernels/ab_launch.py '{}' '{"bwd_intra": {"diag_precision": "tf32"}}' --json ab.json

Each argument is a JSON override of :data:`k3lab.kernels.kda.LAUNCH` (``'{}'``: as shipped; entries are
merged over the shipped ones, as ``bench_kda.py --launch`` does). For each variant: the bf16 relative
errors of the output and all gradients against the float64 torch reference (B2 T1000 H4 D128), then the
forward and forward+backward medians (``triton.testing.do_bench``) at the benchmark's three shapes.
Rows printed by one run are comparable with each other; ratios against fla come from ``bench_kda.py``.
The "Launch parameters" table of ``kernels/RESULTS.md`` was measured with the session's A/B script, of
which this is the tidied copy (same inputs, shapes and medians; the copy itself has not yet run on a GPU).
"""

import argparse
import copy
import json

import torch
import torch.nn.functional as F
import triton

from bench_kda import SHAPES, override_launch
from k3lab.kernels import kda, triton_kda_chunk
from k3lab.mixers.chunk import kda_chunk as reference_chunk


def kda_inputs(B, T, H, D, seed):
    """Leaf inputs as in bench_kda.py (bf16, the K3 gate) and an output gradient."""
    torch.manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).bfloat16().requires_grad_()
    k = F.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).bfloat16().requires_grad_()
    v = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = (-5 * torch.sigmoid(torch.randn(B, T, H, D, device="cuda"))).requires_grad_()
    beta = torch.sigmoid(torch.randn(B, T, H, device="cuda")).bfloat16().requires_grad_()
    return [q, k, v, g, beta], torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)


def errors() -> dict:
    """Relative errors of o, dq, dk, dv, dg, dβ against the float64 reference."""
    xs, do = kda_inputs(2, 1000, 4, 128, seed=0)
    o = triton_kda_chunk(*xs)[0]
    o.backward(do)
    refs = [x.detach().double().requires_grad_() for x in xs]
    o_ref = reference_chunk(*refs)[0]
    o_ref.backward(do.double())
    pairs = zip(("o", "dq", "dk", "dv", "dg", "dbeta"), [o] + [x.grad for x in xs], [o_ref] + [x.grad for x in refs])
    return {name: ((got.double() - want).norm() / want.norm()).item() for name, got, want in pairs}


def timings() -> list:
    """(T, forward ms, forward+backward ms) at each benchmark shape."""
    rows = []
    for B, T, H, D in SHAPES:
        xs, do = kda_inputs(B, T, H, D, seed=1)

        def fwd_bwd():
            for x in xs:
                x.grad = None
            triton_kda_chunk(*xs)[0].backward(do)

        with torch.no_grad():
            fwd = triton.testing.do_bench(lambda: triton_kda_chunk(*xs), warmup=25, rep=150, return_mode="median")
        rows.append((T, fwd, triton.testing.do_bench(fwd_bwd, warmup=25, rep=250, return_mode="median")))
        del xs, do
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", default=["{}"], help="JSON LAUNCH overrides, one per variant")
    parser.add_argument("--json", default=None, help="write every number to this file")
    args = parser.parse_args()
    shipped = copy.deepcopy(kda.LAUNCH)
    records = []
    for variant in args.variants:
        kda.LAUNCH.clear()
        kda.LAUNCH.update(copy.deepcopy(shipped))
        override_launch(kda.LAUNCH, variant)
        err, rows = errors(), timings()
        records.append(dict(variant=variant, errors=err, rows=rows))
        print(f"{variant}: " + " ".join(f"{n} {e:.2e}" for n, e in err.items()) + " | fwd / fwd+bwd ms "
              + "  ".join(f"T{T} {f:.3f} / {fb:.3f}" for T, f, fb in rows), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
