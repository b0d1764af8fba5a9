"""Forward + backward of the fused AttnRes depth mix + RMSNorm (k3lab.kernels.attn_res.attn_res_mix) against the
compiled torch reference (k3lab.residual.attn_res_normed), on CUDA: eager and CUDA-graphed, 16,384 x 1024 bf16.

    python kernels/bench_attn_res.py

(Kept out of k3lab/kernels/: a kernel module does not import the layers that call it.)
"""
import torch
import triton

from k3lab.kernels.attn_res import attn_res_mix
from torch import nn

from k3lab.residual import attn_res_normed

def graphed(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay

N, D, dev = 16384, 1024, "cuda"
torch.manual_seed(0)
proj = nn.Linear(D, 1, bias=False).to(dev)
norm, post = nn.RMSNorm(D, eps=1e-6).to(dev), nn.RMSNorm(D, eps=1e-6).to(dev)
for m in (proj, norm, post):
    torch.nn.init.normal_(m.weight, 1.0 if m is not proj else 0.0, 0.1)
compiled = torch.compile(attn_res_normed)
print(f"N={N} D={D} bf16, forward + backward, ms (eager / CUDA graph)")
print(" S   fused          compiled        ratio (graph)   fused GB/s (graph)")
for S in (2, 3, 5):
    sources = [torch.randn(N, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(S)]
    d_out = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    inputs = [*sources, proj.weight, norm.weight, post.weight]

    def fused():
        out = attn_res_mix(sources, proj.weight, norm.weight, norm.eps, post.weight, post.eps)
        return torch.autograd.grad(out, inputs, d_out)

    def reference():
        return torch.autograd.grad(compiled(sources, proj, norm, post)[0], inputs, d_out)

    ms = [triton.testing.do_bench(f, warmup=50, rep=300) for fn in (fused, reference) for f in (fn, graphed(fn))]
    gbs = (3 * S + 2) * N * D * 2 / ms[1] / 1e6
    print(f"{S:2}   {ms[0]:.3f} / {ms[1]:.3f}  {ms[2]:.3f} / {ms[3]:.3f}   {ms[3] / ms[1]:5.2f}x"
          f"          {gbs:6.0f}")
