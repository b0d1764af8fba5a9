"""k3lab's own Triton kernels (KDA chunked forward/backward and decode), checked against k3lab.mixers.

Set ``TRITON_INTERPRET=1`` before importing this package to run the kernels on CPU (tests, notebooks).
"""

from k3lab.kernels.kda import triton_kda_chunk, kda_decode_step

__all__ = ["triton_kda_chunk", "kda_decode_step"]
