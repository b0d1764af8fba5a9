"""Build the model on the meta device on every rank, shard it, then fill each rank's shards from one
seeded copy: the same weights as one process, with no rank but rank 0 ever holding the whole model.

    rank 0:       torch.manual_seed(seed); source = K3ForCausalLM(cfg)          (CPU, the one-process init)
    every rank:   with torch.device("meta"): model = K3ForCausalLM(cfg)         (no memory, no RNG use)
                  parallelize(model, ...)                                        (EP slices, CP, FSDP2 shards: all meta)
                  model.to_empty(device)                                         (allocate this rank's shards)
                  for each parameter and buffer, in order:
                      FSDP2 shard (DTensor)   distribute_tensor(source tensor, mesh, placements, src_data_rank=0)
                      EP expert slice         broadcast the whole [E, …] tensor from rank 0, keep rows [offset, offset + E/R)
                      anything else           broadcast from rank 0

One tensor is in flight at a time, so besides rank 0's source model a rank holds its shards plus
one whole tensor. (A model too large even for rank 0's host memory would need an initialiser that
runs per shard; K3's own init draws from one RNG stream in construction order, which only a full
construction reproduces.)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from k3lab.moe.latent import LatentMoE, RoutedExperts


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_parameter) for every parameter and buffer (non-persistent ones too), in order."""
    out = [(n, p, True) for n, p in model.named_parameters(remove_duplicate=False)]
    return out + [(n, b, False) for n, b in model.named_buffers(remove_duplicate=False)]


@torch.no_grad()
def materialize_from_rank0(model: nn.Module, source: nn.Module | None, device: torch.device, group=None) -> None:
    """Fill ``model`` (already parallelized on the meta device, then ``to_empty``'d) from rank 0's
    ``source`` (the whole one-process model; None on other ranks). Every rank calls this."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    rank = dist.get_rank(group)
    src = dict((n, t) for n, t, _ in _named_tensors(source)) if rank == 0 else {}
    slices = {id(p): (m.expert_offset, m.num_local_experts) for m in model.modules()
              if isinstance(m, RoutedExperts) for p in m.parameters(recurse=False)}
    for name, t, _ in _named_tensors(model):
        if isinstance(t, DTensor):
            full = src[name].to(device, t.dtype) if rank == 0 else torch.empty(t.shape, dtype=t.dtype, device=device)
            t.to_local().copy_(distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=0).to_local())
            continue
        if id(t) in slices:
            offset, n = slices[id(t)]
            shape = (_whole_rows(model, t), *t.shape[1:])
            full = src[name].to(device, t.dtype) if rank == 0 else torch.empty(shape, dtype=t.dtype, device=device)
            dist.broadcast(full, src=0, group=group)
            t.copy_(full[offset:offset + n])
            continue
        full = src[name].to(device, t.dtype) if rank == 0 else torch.empty(t.shape, dtype=t.dtype, device=device)
        dist.broadcast(full, src=0, group=group)
        t.copy_(full)
    for m in model.modules():  # the balancers' step statistics were made on the meta device: start them at zero
        if isinstance(m, LatentMoE):
            b = m.balancer
            b.bias = m.gate.e_score_correction_bias  # to_empty replaced the meta Parameter the balancer held
            for attr, value in list(vars(b).items()):
                if isinstance(value, torch.Tensor) and value is not b.bias and value.is_meta:
                    setattr(b, attr, torch.zeros(value.shape, dtype=value.dtype, device=b.bias.device))


def _whole_rows(model: nn.Module, t: torch.Tensor) -> int:
    """Experts E of the RoutedExperts holding the slice ``t``."""
    for m in model.modules():
        if isinstance(m, RoutedExperts) and any(p is t for p in m.parameters(recurse=False)):
            return m.num_experts
    raise KeyError("not an expert slice")
