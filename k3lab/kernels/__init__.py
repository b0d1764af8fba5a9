"""k3lab's own Triton kernels, each checked against its plain-PyTorch reference: KDA chunked forward/backward and
decode (against k3lab.mixers), the fused AttnRes depth mix + RMSNorm (against k3lab.residual.attn_res_normed), the
MoE's row sums (``k3lab.kernels.moe_rows``: combine and dispatch backward, against k3lab.moe.latent.LocalDispatcher), and
the fused master-weight AdamW step (``k3lab.kernels.adamw``, against torch.optim.AdamW on fp32 masters).

Set ``TRITON_INTERPRET=1`` before importing this package to run the kernels on CPU (tests, notebooks).
"""

from k3lab.kernels.attn_res import attn_res_mix
from k3lab.kernels.kda import kda_decode_step, triton_kda_chunk

__all__ = ["triton_kda_chunk", "kda_decode_step", "attn_res_mix"]
