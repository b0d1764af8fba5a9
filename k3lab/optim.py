"""Optimizers for k3lab: AdamW groups, Muon with Per-Head Muon, QK-Clip, cosine schedule (docs/k3_reference.md §11).

Which parameter gets which update (docs/k3_reference.md §11, Moonlight/K2 practice):

* **Muon**: 2-D hidden matrices (every ``nn.Linear`` weight inside the blocks, the router included)
  and 3-D stacked expert weights ``[E, out, in]`` (one Newton–Schulz per expert, batched).
  A parameter named in a module's ``muon_head_splits`` (``{"q_proj": H, ...}``) is orthogonalised
  per head: its momentum ``[H·R_h, C]`` is viewed as ``[H, R_h, C]`` and each head's block goes
  through Newton–Schulz separately (K3 "Per-Head Muon").
* **AdamW with weight decay**: embeddings and the LM head (and any other matrix Muon does not take).
* **AdamW without weight decay**: vectors — every 1-D parameter (norm gains, biases, ``A_log``,
  ``dt_bias``) and every parameter with a dimension of size 1 (``[1, D]`` AttnRes pseudo-queries,
  depthwise short-conv kernels ``[C, 1, W]``), which are gains in matrix clothing.

Parameters with ``requires_grad=False`` (the router's ``e_score_correction_bias``) are left out.

Muon update for a matrix ``W [n, m]`` with gradient ``G`` (momentum β = 0.95, Nesterov)::

    M ← β·M + (1 − β)·G                 U = (1 − β)·G + β·M          (Nesterov, as a lerp)
    O = NS5(U)                           5 quintic Newton–Schulz steps in bf16, (a,b,c) = (3.4445, −4.7750, 2.0315)
    W ← W·(1 − η·λ) − η·0.2·sqrt(max(n, m))·O

The scale ``0.2·sqrt(max(n, m))`` is Moonlight's (K2 Alg. 1): an orthogonal ``[n, m]`` matrix has
RMS ``1/sqrt(max(n, m))``, so the update RMS becomes 0.2, about AdamW's, and one learning rate
serves both the Muon and the AdamW groups. (Keller Jordan's original uses ``max(1, n/m)^½`` and a
separate, larger Muon lr.) For a per-head or per-expert block the block's own shape is used.
"""
from __future__ import annotations

import math
import torch
from torch import Tensor, nn

from k3lab.config import DTYPES
from k3lab.mixers.mla import qk_clip_, qk_clip_model_, scale_rows_  # noqa: F401 (QK-Clip lives with MLA; re-exported)

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic Newton–Schulz coefficients
MOONLIGHT_RMS = 0.2                     # update RMS Moonlight matches to AdamW


# ----------------------------------------------------------------------------------------------
# parameter grouping
# ----------------------------------------------------------------------------------------------
def _head_splits(model: nn.Module) -> dict[int, int]:
    """id(param) -> number of head blocks along dim 0, read from modules' ``muon_head_splits``."""
    splits: dict[int, int] = {}
    for mod_name, module in model.named_modules():
        for key, heads in getattr(module, "muon_head_splits", {}).items():
            attr = getattr(module, key, None)
            param = attr.weight if isinstance(attr, nn.Module) else module.get_parameter(key)
            if param.shape[0] % heads != 0:
                raise ValueError(
                    f"muon_head_splits[{key!r}] = {heads} of module {mod_name!r} does not divide "
                    f"dim 0 of its parameter, shape {tuple(param.shape)}"
                )
            splits[id(param)] = int(heads)
    return splits


def _adamw_only_ids(model: nn.Module) -> set[int]:
    """Parameters that stay on AdamW although they are matrices: embeddings, LM heads, convolutions."""
    ids: set[int] = set()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, (nn.Embedding, nn.Conv1d, nn.Conv2d)) or leaf == "lm_head":
            ids.update(id(p) for p in module.parameters(recurse=False))
    return ids


def param_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Split the trainable parameters of ``model`` into ``{"muon", "adamw_decay", "adamw_no_decay"}``.

    Each value is a list of ``(name, param)``; shared (tied) parameters appear once. See the module
    docstring for the rule.
    """
    adamw_only = _adamw_only_ids(model)
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {"muon": [], "adamw_decay": [], "adamw_no_decay": []}
    for name, p in model.named_parameters():  # named_parameters() already drops tied duplicates
        if not p.requires_grad:
            continue
        # a matrix with a single row or column is a vector; the leading dim of a 3-D expert stack is a batch
        # (an expert-parallel slice of one expert, [1, out, in], is still a matrix for Muon)
        if p.ndim < 2 or min(p.shape[-2:]) == 1:
            groups["adamw_no_decay"].append((name, p))
        elif id(p) not in adamw_only and p.ndim in (2, 3):
            groups["muon"].append((name, p))
        else:
            groups["adamw_decay"].append((name, p))
    return groups


# ----------------------------------------------------------------------------------------------
# Muon
# ----------------------------------------------------------------------------------------------
NS_DTYPES = DTYPES  # (the values: k3lab.config.DTYPES) Newton–Schulz precision: bf16 (Keller/Moonlight), fp32 for parity tests


def _full(t: Tensor) -> Tensor:
    """The whole tensor behind a DTensor (FSDP2 shard); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _like(full: Tensor, ref: Tensor) -> Tensor:
    """``full`` laid out as ``ref``: this rank's shard when ``ref`` is a DTensor (every rank holds the
    same ``full``, so taking the local piece needs no communication)."""
    if not hasattr(ref, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, ref.device_mesh, ref.placements, src_data_rank=None)


def newton_schulz5(G: Tensor, steps: int = 5, eps: float = 1e-7, dtype: str = "bfloat16") -> Tensor:
    """Approximate the orthogonal polar factor ``U Vᵀ`` of ``G = U Σ Vᵀ`` (batched over leading dims).

    ``X ← X/(‖X‖_F + eps)``, then ``steps`` times ``X ← aX + (bA + cA²)X`` with ``A = XXᵀ``, in
    ``dtype`` (bf16 by default, as Keller Jordan and Moonlight; "float32" for parity tests: bf16
    rounding alone moves an update by ~16%), on the wide orientation (transposed when rows > cols).
    The quintic is tuned for speed, not convergence: the singular values land in roughly [0.7, 1.2],
    not exactly 1 (Keller Jordan). G: [..., n, m] -> [..., n, m] (in ``dtype``).
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz5 needs a matrix or a batch of matrices, got shape {tuple(G.shape)}")
    if dtype not in NS_DTYPES:
        raise ValueError(f"newton_schulz5: dtype={dtype!r}: allowed values are {NS_DTYPES}")
    a, b, c = NS_COEFFS
    X = G.to(getattr(torch, dtype))
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.mT if tall else X


def muon_direction(update: Tensor, heads: int = 1, ns_steps: int = 5, ns_dtype: str = "bfloat16") -> Tensor:
    """Orthogonalised, Moonlight-scaled Muon direction for one parameter's (Nesterov) momentum.

    update: [n, m] (``heads`` row blocks, each ``[n/heads, m]``, orthogonalised separately) or
    [E, n, m] (stacked experts, one NS per expert). Returns ``0.2·sqrt(max(rows, cols))·NS5(block)``
    per block, same shape and dtype as ``update``.
    """
    if update.ndim == 2:
        blocks = update.reshape(heads, update.shape[0] // heads, update.shape[1])  # [H, n/H, m]
    elif update.ndim == 3 and heads == 1:
        blocks = update                                                           # [E, n, m]
    else:
        raise ValueError(f"muon_direction: shape {tuple(update.shape)} with heads={heads} is not supported "
                         "(2-D matrices with any heads, or 3-D stacks with heads=1)")
    rows, cols = blocks.shape[-2:]
    ortho = newton_schulz5(blocks, steps=ns_steps, dtype=ns_dtype).to(update.dtype)
    return (ortho * (MOONLIGHT_RMS * math.sqrt(max(rows, cols)))).reshape(update.shape)


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer holding Muon groups (``use_muon=True``) and AdamW groups (``use_muon=False``).

    Muon groups take ``lr, momentum, nesterov, ns_steps, ns_dtype, weight_decay`` and, per parameter,
    a head count from the group's ``heads`` list (1 = whole matrix). Under FSDP2 a parameter is a
    DTensor shard: its update is gathered into the whole matrix, orthogonalised whole (per head),
    and each rank keeps its own rows (the Newton–Schulz runs redundantly on every rank; the
    momentum stays sharded). AdamW groups take
    ``lr, betas, eps, weight_decay`` (decoupled: ``p ← p(1 − lr·wd)``). ``state_dict`` /
    ``load_state_dict`` are the stock ``torch.optim.Optimizer`` ones.
    """

    def __init__(self, groups: list[dict]):
        defaults = dict(lr=1e-3, weight_decay=0.0, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype="bfloat16",
                        betas=(0.9, 0.95), eps=1e-8, use_muon=False, heads=None)
        super().__init__(groups, defaults)
        for g in self.param_groups:
            if g["use_muon"] and g["heads"] is not None and len(g["heads"]) != len(g["params"]):
                raise ValueError(f"Muon group: len(heads)={len(g['heads'])} != len(params)={len(g['params'])}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            if g["use_muon"]:
                self._muon_group(g)
            else:
                self._adamw_group(g)
        return loss

    def _muon_group(self, g: dict) -> None:
        heads = g["heads"] or [1] * len(g["params"])
        beta = g["momentum"]
        for p, h in zip(g["params"], heads):
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            buf = state["momentum_buffer"]
            grad = p.grad.float()
            buf.lerp_(grad, 1 - beta)                                  # M ← βM + (1−β)G
            update = grad.lerp(buf, beta) if g["nesterov"] else buf    # U = (1−β)G + βM
            direction = _like(muon_direction(_full(update), heads=h, ns_steps=g["ns_steps"], ns_dtype=g["ns_dtype"]),
                              update)
            p.mul_(1 - g["lr"] * g["weight_decay"])
            p.add_(direction.to(p.dtype), alpha=-g["lr"])

    def _adamw_group(self, g: dict) -> None:
        beta1, beta2 = g["betas"]
        for p in g["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
            t = state["step"].item()
            grad = p.grad.float()
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt_().add_(g["eps"])
            p.mul_(1 - g["lr"] * g["weight_decay"])
            p.add_((state["exp_avg"] / (1 - beta1 ** t) / denom).to(p.dtype), alpha=-g["lr"])


# ----------------------------------------------------------------------------------------------
# builder and schedule
# ----------------------------------------------------------------------------------------------
def build_optimizer(
    model: nn.Module,
    name: str = "adamw",
    lr: float = 3e-3,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    muon_lr: float | None = None,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    per_head: bool = True,
    ns_dtype: str = "bfloat16",
    foreach: bool | None = None,
    fused: bool | None = None,
) -> torch.optim.Optimizer:
    """Build the optimizer for ``model``.

    name="adamw": ``torch.optim.AdamW`` with two groups (decay on ≥2-D params, none on 1-D).
    name="muon": :class:`MuonAdamW` — Muon (lr ``muon_lr``, default ``lr``: the Moonlight scale makes
    one lr fit both) on 2-D hidden matrices and 3-D expert stacks, Per-Head Muon where a module sets
    ``muon_head_splits`` (``per_head=False`` turns that off for ablations), AdamW on the rest.
    ``ns_dtype``: the Newton–Schulz precision (:data:`NS_DTYPES`). ``foreach``: passed to AdamW
    (None = torch's default; the distributed trainer sets False when DTensor and plain parameters mix).
    ``fused``: AdamW's one-kernel-per-group CUDA implementation (None = on when every parameter is a plain
    CUDA tensor and ``foreach`` is None; it rounds like foreach within fp32 ulps, not bit for bit).
    Every group carries ``initial_lr`` so a schedule can scale each group's lr (see :func:`set_lr`).
    """
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"build_optimizer: ns_dtype={ns_dtype!r}: allowed values are {NS_DTYPES}")
    groups = param_groups(model)
    decay = [p for _, p in groups["adamw_decay"]]
    no_decay = [p for _, p in groups["adamw_no_decay"]]
    if name == "adamw":
        opt_groups = [
            dict(params=decay + [p for _, p in groups["muon"]], weight_decay=weight_decay),
            dict(params=no_decay, weight_decay=0.0),
        ]
        opt_groups = [g for g in opt_groups if g["params"]]
        for g in opt_groups:
            g["initial_lr"] = lr
        if fused is None:
            fused = foreach is None and all(type(p) is torch.nn.Parameter and p.is_cuda for g in opt_groups for p in g["params"])
        if fused:
            return torch.optim.AdamW(opt_groups, lr=lr, betas=betas, eps=eps, fused=True)
        return torch.optim.AdamW(opt_groups, lr=lr, betas=betas, eps=eps, foreach=foreach)
    if name == "muon":
        splits = _head_splits(model) if per_head else {}
        muon = [p for _, p in groups["muon"]]
        mlr = lr if muon_lr is None else muon_lr
        opt_groups = [
            dict(params=muon, use_muon=True, lr=mlr, initial_lr=mlr, weight_decay=weight_decay,
                 momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_dtype=ns_dtype,
                 heads=[splits.get(id(p), 1) for p in muon]),
            dict(params=decay, use_muon=False, lr=lr, initial_lr=lr, weight_decay=weight_decay, betas=betas, eps=eps),
            dict(params=no_decay, use_muon=False, lr=lr, initial_lr=lr, weight_decay=0.0, betas=betas, eps=eps),
        ]
        return MuonAdamW([g for g in opt_groups if g["params"]])
    raise ValueError(f"build_optimizer: name must be 'adamw' or 'muon', got {name!r}")


def cosine_lr(step: int, total_steps: int, warmup_steps: int, base_lr: float, min_ratio: float = 0.1) -> float:
    """Linear warmup to ``base_lr`` over ``warmup_steps``, then cosine decay to ``min_ratio·base_lr``
    at ``total_steps`` (K3: cosine with 1% warmup and a fixed minimum lr).

    lr(s) = base·(s+1)/warmup                                  for s < warmup
    lr(s) = base·(min + (1 − min)·½(1 + cos(π·p))), p = (s − warmup)/(total − warmup) clipped to [0, 1]
    """
    if total_steps < 1 or warmup_steps < 0 or warmup_steps > total_steps:
        raise ValueError(f"cosine_lr: need total_steps >= 1 and 0 <= warmup_steps <= total_steps, "
                         f"got total_steps={total_steps}, warmup_steps={warmup_steps}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, step: int, total_steps: int, warmup_steps: int,
           min_ratio: float = 0.1) -> float:
    """Set every group's lr to ``cosine_lr(step, ..., group["initial_lr"])``; returns the first group's lr."""
    for g in optimizer.param_groups:
        g["lr"] = cosine_lr(step, total_steps, warmup_steps, g.get("initial_lr", g["lr"]), min_ratio)
    return optimizer.param_groups[0]["lr"]

