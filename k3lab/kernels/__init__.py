"""k3lab's own Triton kernels, each checked against its plain-PyTorch reference: KDA chunked forward/backward and
decode (against k3lab.mixers), the fused AttnRes depth mix + RMSNorm (against k3lab.residual.attn_res_normed), the
MoE's row sums (``k3lab.kernels.moe_rows``: combine and dispatch backward, against k3lab.moe.latent.LocalDispatcher),
the fused master-weight AdamW step (``k3lab.kernels.adamw``, against torch.optim.AdamW on fp32 masters), and decode
kernels: a split-K GEMV for at most 16 rows (``k3lab.kernels.gemv``, against ``small_linear_reference``; used by every
model linear layer through ``k3lab.linear``), the routed experts of at most 128 token slots without a sort
(``k3lab.kernels.moe_decode``, against ``routed_experts_decode_reference`` and the sorted path), and the KDA layer's
one-token step with its short convolutions, norms and gate (``k3lab.kernels.kda_decode_fused``); the three decode
kernels are on by default (each module's ``ENABLED``; False: the reference launches) since the GPU suite ran with
them on and ``kernels/bench_generate.py`` timed them.

Set ``TRITON_INTERPRET=1`` before importing this package to run the kernels on CPU (tests, notebooks).
"""

from k3lab.kernels.attn_res import attn_res_mix
from k3lab.kernels.kda import kda_decode_step, triton_kda_chunk

__all__ = ["triton_kda_chunk", "kda_decode_step", "attn_res_mix"]
