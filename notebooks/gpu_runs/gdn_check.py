"""Gated DeltaNet's chunked form against its recurrence at notebook 01's GPU shape (issue 29): forward and gradients,
eagerly and (on CUDA) replayed from a CUDA graph, with the gates a GPU-scale MixerLM makes and 300x stronger ones.

On 2026-12-04 Gated DeltaNet stayed at chance on MQAR at the GPU scale (loss ln 127 after 1,000 steps) while Mamba2
and KDA reached 0.99; on a CPU this comparison agrees to ~3e-7 (float32) at chunk 64 and GDN learns at a reduced size
at the same lr. GDN is the only one of the three on the torch chunk path with ``torch.linalg.solve_triangular`` on
CUDA, so this script is the first thing to run on the device (seconds):

    python notebooks/gpu_runs/gdn_check.py            # exit 1 if any relative error exceeds 1e-4
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from k3lab.data import mqar  # noqa: E402
from k3lab.experiments.toy import MixerLM  # noqa: E402
from k3lab.mixers import chunk, lineage  # noqa: E402
from k3lab.testing import rel_err  # noqa: E402


def gdn_inputs(device, rows=2):
    """The (q, k, v, g, beta) the first GDN layer of 01's GPU-scale model gets on MQAR rows (d 128, T 256, 2 heads)."""
    torch.manual_seed(0)
    model = MixerLM(256, 128, 2, "gated_deltanet", 2, chunk_size=64).to(device)
    captured, orig = [], chunk.gated_deltanet_chunk
    chunk.gated_deltanet_chunk = lambda *a, **k: captured.append([x.detach() for x in a[:5]]) or orig(*a, **k)
    try:
        model(mqar(256, rows, 256, 64, seed=0)[0].to(device))
    finally:
        chunk.gated_deltanet_chunk = orig
    return captured[0]


def compare(device, graphed: bool, g_scale: float) -> float:
    q, k, v, g, beta = gdn_inputs(device)
    args = [t.clone().float().requires_grad_() for t in (q, k, v, g * g_scale, beta)]
    w = torch.randn(q.shape[:3] + (v.shape[-1],), generator=torch.Generator().manual_seed(1)).to(device)
    o_ref = lineage.gated_deltanet_recurrent(*args)[0]
    ref = [o_ref.detach(), *torch.autograd.grad((o_ref * w).sum(), args)]

    def step():
        o = chunk.gated_deltanet_chunk(*args, chunk_size=64, output_final_state=False)[0]
        return [o.detach(), *torch.autograd.grad((o * w).sum(), args)]

    if graphed:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        graph.replay()
        torch.cuda.synchronize()
    else:
        out = step()
    return max(rel_err(a, b) for a, b in zip(out, ref))


def main() -> int:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    worst = 0.0
    for device in devices:
        for graphed in ([False, True] if device == "cuda" else [False]):
            for g_scale in (1.0, 300.0):
                err = compare(device, graphed, g_scale)
                worst = max(worst, err)
                print(f"{device:5s} {'graph' if graphed else 'eager':5s} gates x{g_scale:<5g} chunk 64 vs recurrence: "
                      f"largest relative error (output, 5 gradients) {err:.1e}", flush=True)
    print("OK" if worst < 1e-4 else "MISMATCH: the chunked GDN disagrees with its recurrence")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
