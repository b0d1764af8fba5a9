"""Low-precision parameters with fp32 master weights (``TrainConfig.param_dtype="bfloat16"``).

The model holds its trainable floating parameters ``p`` in bf16 (forward and backward run on them
directly, under bf16 autocast); the optimizer holds an fp32 **master** copy ``w`` of each and steps
that. One training step, for every trainable parameter::

    g   = ∂loss/∂p                            bf16, from backward on the bf16 model
    G   = float32(g)                          exact (every bf16 value is an fp32 value); g is freed
    c   = min(1, τ / ‖(G_1, …, G_n)‖₂)        global grad-norm clip on the fp32 master grads (τ = grad_clip)
    w   ← OptimizerStep(w, c·G)               AdamW (fused or not) or Muon, state in fp32, on the masters
    p   ← bf16(w)                             round to nearest even

Without masters an update ``Δ`` smaller than half a bf16 ulp of ``p`` (``|Δ| < 2⁻⁹·|p|``, e.g. a step
of 1e-3 against a weight of 1) rounds away every step and the weight never moves; with masters ``w``
accumulates it and ``p`` moves once the sum crosses the rounding boundary. ``p = bf16(w)`` holds after
every step: ``p`` and ``w`` differ by at most half a bf16 ulp of ``w``.

Bytes per trainable parameter, beside the optimizer state (AdamW: 8, fp32 moments; Muon: 4, fp32
momentum, on its matrices), which is the same in all cases::

                                            between steps      end of backward           optimizer step
    param_dtype="float32"                   p 4                p 4 + g 4 = 8             8
    param_dtype="bfloat16"                  p 2 + w 4 = 6      p 2 + g 2 + w 4 = 8       p 2 + w 4 + G 4 = 10
      master_format="split" (fused only)    p 2 + lo 2 = 4     p 2 + g 2 + lo 2 = 6      6 (no G)

(``G`` replaces ``g`` one parameter at a time, so the step peaks at 10, not 12; the fused step makes no
``G``: 8 with float32 masters.) float32 parameters under bf16 autocast also hold a bf16 copy of every
weight during forward and backward (+2, autocast's cast, kept for backward), which bf16 parameters do not
need. So the parameter side costs about the same; what bf16 parameters save is that per-step cast of
every weight (a 4 B read and a 2 B write per parameter) and, in a distributed run, half the bytes of
every gradient reduced.

Updates made to the bf16 parameters outside the optimizer (QK-Clip rescales MLA rows in
``model.after_optimizer_step()``) are taken into the masters: a parameter whose in-place version
counter changed since the copy-back gets ``w ← float32(p)`` where ``p ≠ bf16(w)`` (only the changed
elements lose their sub-ulp part); this runs before the next step and before ``state_dict()``.

The fused step (``fused``: on by default where it applies — a wrapped ``torch.optim.AdamW`` without
amsgrad or maximize, every parameter a contiguous bf16 CUDA tensor): :meth:`MasterWeightOptimizer.clip_grad_norm_`
computes the global norm from the bf16 gradients in float32 (no ``G`` is made) and keeps the clip
coefficient ``c`` on the device; :meth:`~MasterWeightOptimizer.step` then runs the clip, the AdamW update of
the masters and the bf16 copy-back as one Triton kernel launch per parameter group (:mod:`k3lab.kernels.adamw`: 28
bytes of traffic a parameter instead of 40, and no fp32 gradients in memory). The optimizer state
it keeps is torch's AdamW state (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints load either
way; the two paths agree within float32 rounding, not bit for bit. ``moment_dtype="bfloat16"`` (fused
step only) stores AdamW's ``exp_avg`` and ``exp_avg_sq`` in bf16, rounded to nearest even after each
update (:mod:`k3lab.kernels.adamw` says what that rounding costs): 12 bytes a parameter for the
optimizer side instead of 16 (``small``: 6.3 GiB less).

Split masters (``master_format="split"``, :data:`MASTER_FORMATS`; the fused step only): no fp32 tensor is
kept. The bf16 parameter ``p`` is the master's high half and an int16 tensor ``lo`` the rest, on the raw
bit patterns (:func:`join_master`, :func:`split_master`; the kernel does the same in integer operations)::

    bits(w) = (bits(p) << 16) + lo      int32 arithmetic (mod 2³²) on w's fp32 bits; lo ∈ [−32768, 32767]
    hi = (b + 0x8000) >> 16             the split of b = bits(w) (as uint32; logical shift)
    lo = b − (hi << 16),  p = the bf16 with bits hi

The master is exact: ``join(p, lo)`` is, bit for bit, the float32 master the ``"float32"`` format would hold
(the same kernel arithmetic on the same ``w``), and so are the moments. ``p`` is ``bf16(w)`` except at exact
ties (``w``'s low 16 bits 0x8000), which the split rounds away from zero where nearest-even rounds to even;
a NaN master becomes the quiet NaN (``p`` = 0x7FC0, ``lo`` = 0), its payload lost. 2 bytes a parameter
less (``small``: 1.68B parameters, 3.35 GiB), and 18 bytes of kernel traffic a parameter instead of 20 (bf16
moments). :attr:`MasterWeightOptimizer.masters` are then the ``lo`` tensors: the wrapped
``torch.optim.AdamW`` holds them in its ``param_groups`` and keys its state (``step``, ``exp_avg``,
``exp_avg_sq``) by them; it never steps them itself. Outside updates: :meth:`~MasterWeightOptimizer.sync_from_params`
does nothing, the master is always ``join(p, lo)``. A changed ``p`` keeps the old low bits, so ``w`` moves
with ``p`` and stays within half a bf16 ulp of it, and ``p`` is still its rounding — where the float32
format sets ``w ← float32(p)`` on the changed elements, dropping the sub-ulp part (the two differ there by
at most that). A write of ±0 or ±inf over a ``p`` whose ``lo`` points the other way (a ``lo`` < 0 under ±0,
> 0 under ±inf) would join into a NaN; a split never makes such a pair, and QK-Clip's scaling by
``γ ∈ (0, 1]`` does not either unless a weight underflows to 0.

Sharded parameters (FSDP2's DTensors, ``TrainConfig.moment_dtype="bfloat16"`` or ``master_format="split"`` above
world size 1: :func:`k3lab.train.shard_masters`): the masters, ``lo`` and the moments are DTensors laid out as
their parameters, and the fused step runs on the local shards (:func:`local`): the step is elementwise, so each
rank does to its rows what one process does to them. The clip needs the global norm: a parallel run passes it
(``clip_grad_norm_(max_norm, norm=...)``, from :func:`k3lab.parallel.fsdp.grad_norm`). Where the kernel does not
run (the CPU: gloo tests) and the configuration needs the fused step (bf16 moments, split masters), its
plain-PyTorch reference :func:`master_adamw_reference_` runs instead (``fused`` True, :attr:`~MasterWeightOptimizer.kernel` False).

Checkpoints: ``state_dict()`` is the wrapped optimizer's, with each parameter's master added to its
state under ``"master"`` as an fp32 tensor in either format (so :mod:`k3lab.checkpoint` writes it into
``optimizer.safetensors``, and a checkpoint resumes in either format); ``load_state_dict()`` restores the
masters exactly and copies ``bf16(w)`` into the model (split: ``(p, lo) = split(w)``), so a resumed run
continues bit for bit.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from k3lab.config import DTYPES

PARAM_DTYPES = DTYPES  # (the values: k3lab.config.DTYPES) TrainConfig.param_dtype: "bfloat16" = bf16 params + fp32 masters
MOMENT_DTYPES = DTYPES  # (the values: k3lab.config.DTYPES) TrainConfig.moment_dtype: AdamW's m and v (bf16: the fused step only)
MASTER_FORMATS = ("float32", "split")    # TrainConfig.master_format: fp32 masters as such, or p + int16 lo (fused only)
MASTER_KEY = "master"                    # the masters' key in each parameter's optimizer state

__all__ = ["PARAM_DTYPES", "MOMENT_DTYPES", "MASTER_FORMATS", "MASTER_KEY", "cast_params_", "split_master",
           "join_master", "adamw_scalars", "master_adamw_reference_", "local", "MasterWeightOptimizer"]


def split_master(w: Tensor) -> tuple[Tensor, Tensor]:
    """The split master format of an fp32 tensor ``w`` -> ``(p bf16, lo int16)``, both of ``w``'s shape, with
    ``bits(w) = (bits(p) << 16) + lo`` (int32, mod 2³²); the reference for the fused kernel's split. On the
    uint32 bit pattern ``b`` of each element (in int64 here, so every shift is a logical one)::

        hi = (b + 0x8000) >> 16          round to nearest on the magnitude, ties away from zero
        lo = b − (hi << 16)              = ((b + 0x8000) & 0xFFFF) − 0x8000 ∈ [−32768, 32767]
        p  = the bf16 with bits hi       (mod 2¹⁶)

    ``p = w.to(torch.bfloat16)`` except where ``b``'s low 16 bits are 0x8000 (a tie: away from zero, where
    nearest even may round the other way). ±inf -> (±inf, 0); ±(largest finite) -> (±inf, −1); NaN -> (0x7FC0,
    0), whatever its payload (so ``join_master`` gives a NaN back, not the same one). ValueError unless ``w`` is
    float32."""
    if w.dtype != torch.float32:
        raise ValueError(f"split_master: w must be a float32 tensor, got {w.dtype}")
    bits = w.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # uint32 bit patterns, in [0, 2³²)
    rounded = bits + 0x8000
    hi = (rounded >> 16) & 0xFFFF    # mod 2¹⁶: b >= 0xFFFF8000 (negative NaNs) wraps, replaced below
    lo = (rounded & 0xFFFF) - 0x8000
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    hi = torch.where(nan, 0x7FC0, hi)
    lo = torch.where(nan, 0, lo)
    p = (hi - ((hi >> 15) << 16)).to(torch.int16).view(torch.bfloat16)  # [0, 2¹⁶) -> the int16 of the same bits
    return p, lo.to(torch.int16)


def join_master(p: Tensor, lo: Tensor) -> Tensor:
    """The fp32 master of the split format: ``bits(w) = (bits(p) << 16) + lo`` (int32 arithmetic, mod 2³²),
    from ``p`` bf16 and ``lo`` int16 of one shape; a new float32 tensor on their device. The reference for the
    fused kernel's join; :func:`split_master`'s inverse (bit for bit, NaNs aside). ValueError on other dtypes
    or shapes."""
    if p.dtype != torch.bfloat16 or lo.dtype != torch.int16 or p.shape != lo.shape:
        raise ValueError(f"join_master: p must be bfloat16 and lo int16 of one shape, got p {p.dtype} "
                         f"{tuple(p.shape)}, lo {lo.dtype} {tuple(lo.shape)}")
    bits = p.contiguous().view(torch.int16).to(torch.int64) * 65536 + lo.to(torch.int64)  # ≡ (bits(p) << 16) + lo
    bits = ((bits + 2**31) & 0xFFFFFFFF) - 2**31  # mod 2³², into int32's range
    return bits.to(torch.int32).view(torch.float32)


def adamw_scalars(lr: float, beta1: float, beta2: float, weight_decay: float, step: int) -> tuple[float, float, float]:
    """The fused step's three scalars (the kernel's ``hyper [3]``): ``(1 − lr·λ, lr / (1 − β1ᵗ), √(1 − β2ᵗ))``,
    in double on the host (rounded to float32 once, when written to the device)."""
    if step < 1:
        raise ValueError(f"step={step}: AdamW steps count from 1")
    return 1.0 - lr * weight_decay, lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step)


@torch.no_grad()
def master_adamw_reference_(master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, param: Tensor,
                            clip: Tensor, hyper: Tensor, *, beta1: float, beta2: float, eps: float) -> None:
    """The fused master-weight AdamW step (:mod:`k3lab.kernels.adamw`'s module docstring) on one tensor, in plain
    PyTorch: the kernel's float32 operations in the kernel's order, so where no fused multiply-add intervenes (the
    CPU; Triton's interpreter) the same bits. In place on ``master`` (float32 ``w``, or the split format's int16
    ``lo``: ``w = join_master(param, lo)``), ``exp_avg`` and ``exp_avg_sq`` (float32, or bf16: rounded to nearest
    even after their update, before ``w`` reads them) and ``param`` (bf16: ``bf16(w)``, split: ``w``'s high half),
    from ``grad`` (bf16) and ``clip`` (0-d float32). ``hyper [3]`` float32: :func:`adamw_scalars` on the device.
    The five tensors: one shape, plain (a DTensor's local shard), on one device; ValueError otherwise."""
    tensors = dict(master=master, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, param=param)
    bad = [k for k, t in tensors.items() if t.shape != master.shape or t.device != master.device]
    if bad or param.dtype != torch.bfloat16 or master.dtype not in (torch.float32, torch.int16):
        raise ValueError(f"master_adamw_reference_: master float32|int16, param bf16, all of master's shape "
                         f"{tuple(master.shape)} on {master.device}; got "
                         + ", ".join(f"{k} {t.dtype} {tuple(t.shape)} on {t.device}" for k, t in tensors.items()))
    f32 = torch.float32
    decay, step_size, bc2_sqrt = hyper.to(f32).unbind()
    b1, b2, e = (torch.tensor(x, dtype=f32, device=master.device) for x in (beta1, beta2, eps))  # as the kernel's fp32 args
    split = master.dtype == torch.int16
    g = grad.to(f32) * clip.to(f32)
    w = (join_master(param, master) if split else master) * decay
    m = b1 * exp_avg.to(f32) + (1 - b1) * g
    v = b2 * exp_avg_sq.to(f32) + (1 - b2) * g * g
    m, v = m.to(exp_avg.dtype), v.to(exp_avg_sq.dtype)  # the stored moments are what w reads (bf16: rounded)
    w = w - step_size * m.to(f32) / (torch.sqrt(v.to(f32)) / bc2_sqrt + e)
    if split:
        p, lo = split_master(w)
        master.copy_(lo)
        param.copy_(p)
    else:
        master.copy_(w)
        param.copy_(w.to(torch.bfloat16))  # round to nearest even
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


class _ReferenceLaunch:
    """:class:`k3lab.kernels.adamw.AdamWLaunch`'s surface over :func:`master_adamw_reference_`, one tensor at a
    time: what :class:`MasterWeightOptimizer` runs where the kernel does not (the CPU without the interpreter)."""

    def __init__(self, masters, grads, exp_avgs, exp_avg_sqs, params, device: torch.device):
        self.members = list(zip(masters, grads, exp_avgs, exp_avg_sqs, params))
        self.hyper = torch.zeros(3, dtype=torch.float32, device=device)  # [decay, step_size, bc2_sqrt]

    def set_scalars(self, scalars: tuple[float, float, float]) -> None:
        """The step's :func:`adamw_scalars`, as the kernel's launch takes them."""
        self.hyper.copy_(torch.tensor(scalars, dtype=torch.float32))

    def launch(self, clip: Tensor, beta1: float, beta2: float, eps: float) -> None:
        for w, g, m, v, p in self.members:
            master_adamw_reference_(w, g, m, v, p, clip, self.hyper, beta1=beta1, beta2=beta2, eps=eps)


def local(t: Tensor) -> Tensor:
    """A DTensor's local shard (FSDP2: this rank's rows, a view of its storage), a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _version(p: Tensor) -> int:
    """The in-place version counter of ``p``'s storage: its local shard's for a DTensor (QK-Clip and the
    optimizer write the shard)."""
    return local(p)._version


def _like(local_tensor: Tensor, ref: Tensor) -> Tensor:
    """``local_tensor`` laid out as ``ref``: the DTensor of ``ref``'s mesh, placements, shape and stride whose local
    shard it is (FSDP2's uneven shards included); ``local_tensor`` itself when ``ref`` is plain."""
    if not hasattr(ref, "to_local"):
        return local_tensor
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local_tensor, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
                              stride=ref.stride())


def cast_params_(model: nn.Module, dtype: str = "bfloat16") -> int:
    """Cast every trainable floating parameter of ``model`` to ``dtype`` in place (``p.data``: the
    Parameter objects, ties and hooks stay); returns how many were cast.

    Buffers and parameters with ``requires_grad=False`` (the router's fp32 ``e_score_correction_bias``)
    keep the dtype the model gave them. ValueError when ``dtype`` is not in :data:`PARAM_DTYPES` or
    the model has no trainable floating parameter.
    """
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"cast_params_: dtype={dtype!r}: allowed values are {PARAM_DTYPES}")
    target = getattr(torch, dtype)
    params = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    if not params:
        raise ValueError(f"TrainConfig.param_dtype={dtype!r}: {type(model).__name__} has no trainable floating "
                         "parameter to cast")
    for p in params:
        p.data = p.data.to(target)
    return len(params)


class MasterWeightOptimizer:
    """An optimizer over fp32 master copies of a model's (bf16) parameters; see the module docstring.

        optimizer = MasterWeightOptimizer(model, build_optimizer(model, "muon", lr=...))
        loss.backward()
        masters = optimizer.grads_to_masters()       # fp32 grads on the masters, the bf16 grads freed
        nn.utils.clip_grad_norm_(masters, 1.0)      # clip (and log) on the fp32 grads
        optimizer.step()                            # step the masters, then p <- bf16(master)
        optimizer.zero_grad(set_to_none=True)

    ``optimizer`` is built over the model's parameters (so :func:`k3lab.optim.build_optimizer`'s
    grouping rules apply unchanged) and must not have stepped yet; each parameter in its
    ``param_groups`` is replaced, in place, by its master (matched by identity, so per-parameter
    lists such as Muon's ``heads`` stay aligned). ``param_groups`` and ``state`` are the wrapped
    optimizer's (``k3lab.optim.set_lr`` works on them). ``masters`` lists the masters in the
    model's ``parameters()`` order (trainable parameters only).

    ``master_format`` (:data:`MASTER_FORMATS`): ``"float32"``, the masters are fp32 tensors; ``"split"`` (the
    fused step only, ValueError otherwise), the masters are int16 tensors ``lo``, zero at construction (the
    parameters are bf16 already, so the master is exactly ``float32(p)``), and the fp32 master is
    ``join_master(p, lo)`` (the module docstring; :meth:`float32_masters`). torch's AdamW takes the int16
    tensors in its ``param_groups`` as it takes any leaf tensor (it checks no dtype there, and on load casts
    state only to floating parameters' dtypes, so the moments keep theirs); only the fused kernel reads and
    writes them, :meth:`step` never calls the wrapped ``step()`` in this format.

    ``fused``: whether the fused step runs (clip inside the step, moments in ``moment_dtype``); ``kernel``: whether
    it runs as the Triton kernel (else as :func:`master_adamw_reference_`, chosen with ``fused=None`` where the kernel
    does not run and bf16 moments or split masters need the fused step). Parameters may be DTensor shards
    (the module docstring).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, fused: bool | None = None,
                 moment_dtype: str = "float32", master_format: str = "float32"):
        if optimizer.state:
            raise ValueError("MasterWeightOptimizer: wrap the optimizer before its first step (it already has state)")
        if isinstance(optimizer, MasterWeightOptimizer):
            raise ValueError("MasterWeightOptimizer: the optimizer is already wrapped")
        if moment_dtype not in MOMENT_DTYPES:
            raise ValueError(f"TrainConfig.moment_dtype={moment_dtype!r}: allowed values are {MOMENT_DTYPES}")
        if master_format not in MASTER_FORMATS:
            raise ValueError(f"TrainConfig.master_format={master_format!r}: allowed values are {MASTER_FORMATS}")
        in_groups = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self.optimizer = optimizer
        self.params: list[nn.Parameter] = [p for p in model.parameters() if id(p) in in_groups]
        if len(self.params) != len(in_groups):
            raise ValueError(f"MasterWeightOptimizer: {len(in_groups) - len(self.params)} optimizer parameters "
                             "are not parameters of the model")
        if any(not p.is_floating_point() for p in self.params):
            raise ValueError("MasterWeightOptimizer: every optimized parameter must be floating point")
        why_not = self.why_not_fused()
        if fused and why_not:
            raise ValueError(f"MasterWeightOptimizer(fused=True): {why_not}; use fused=False (or None: fused where it applies)")
        self.kernel = why_not is None and fused is not False  # the fused step as the Triton kernel
        needed = moment_dtype != "float32" or master_format == "split"  # only the fused step keeps these
        why_not_reference = self.why_not_reference()
        # fused=None where the kernel does not run (the CPU) but the configuration needs the fused step: its reference
        self.fused = self.kernel or (fused is None and needed and why_not_reference is None)
        why_not = why_not_reference or why_not or "fused=False was asked for"
        if moment_dtype != "float32" and not self.fused:
            raise ValueError(f"TrainConfig.moment_dtype={moment_dtype!r} needs the fused AdamW step, which does not "
                             f"run here: {why_not}; use moment_dtype='float32'")
        if master_format == "split" and not self.fused:
            raise ValueError(f"TrainConfig.master_format={master_format!r} needs the fused AdamW step (only it "
                             "rebuilds the master from the bf16 parameter and its int16 low half, and splits it back), "
                             f"which does not run here: {why_not}; use master_format='float32'")
        self.moment_dtype = getattr(torch, moment_dtype)
        self.master_format = master_format
        if master_format == "split":  # lo = 0: join(p, 0) = float32(p), the master of a bf16 parameter
            self.masters: list[Tensor] = [torch.zeros_like(p, dtype=torch.int16) for p in self.params]
        else:
            self.masters = [p.detach().to(torch.float32, copy=True) for p in self.params]
        master_of = {id(p): w for p, w in zip(self.params, self.masters)}
        for g in optimizer.param_groups:
            g["params"] = [master_of[id(p)] for p in g["params"]]
        self._versions = [_version(p) for p in self.params]
        self._param_of = {id(w): p for p, w in zip(self.params, self.masters)}
        self._keep_grads = False
        self._clip: Tensor | None = None  # the fused step's clip coefficient (0-d float32, on the device)
        self._steps: dict[int, int] = {}  # id(master) -> AdamW step count on the host (the kernel's bias corrections)
        self._launches: dict[tuple, object] = {}  # (group index, ids of the masters) -> AdamWLaunch, while keep_grads

    @property
    def keep_grads(self) -> bool:
        """True: the fused step leaves the bf16 gradients in place (a CUDA graph replays into the same tensors)
        and keeps its launches for them; setting it drops the kept launches."""
        return self._keep_grads

    @keep_grads.setter
    def keep_grads(self, value: bool) -> None:
        self._keep_grads = bool(value)
        self._launches.clear()

    @property
    def clip_coef(self) -> Tensor | None:
        """The clip coefficient the fused :meth:`step` applies next (0-d float32, on the device), as the last
        fused :meth:`clip_grad_norm_` set it; None when there is none (no clip since the last step, or unfused)."""
        return self._clip

    def why_not_fused(self) -> str | None:
        """None when the fused AdamW step applies to this optimizer and these parameters, else the reason."""
        import os

        if type(self.optimizer) is not torch.optim.AdamW:
            return f"the fused step is AdamW's, the wrapped optimizer is {type(self.optimizer).__name__}"
        if any(g.get("amsgrad") or g.get("maximize") for g in self.optimizer.param_groups):
            return "the fused step has no amsgrad or maximize"
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # CPU tests of the kernel
        if not all((p.is_cuda or interpreted) and p.dtype == torch.bfloat16 and local(p).is_contiguous()
                   for p in self.params):
            return "the fused step needs every parameter to be a contiguous bf16 CUDA tensor"
        try:
            import k3lab.kernels.adamw  # noqa: F401
        except ImportError as err:
            return f"k3lab.kernels.adamw does not import ({err})"
        return None

    def why_not_reference(self) -> str | None:
        """None when the fused step's plain-PyTorch reference (:func:`master_adamw_reference_`, any device) applies:
        a wrapped ``torch.optim.AdamW`` without amsgrad or maximize over bf16 parameters; else the reason."""
        if type(self.optimizer) is not torch.optim.AdamW:
            return f"the fused step is AdamW's, the wrapped optimizer is {type(self.optimizer).__name__}"
        if any(g.get("amsgrad") or g.get("maximize") for g in self.optimizer.param_groups):
            return "the fused step has no amsgrad or maximize"
        if not all(p.dtype == torch.bfloat16 for p in self.params):
            return "the fused step needs every parameter to be a bf16 tensor"
        return None

    def param_of(self, master: Tensor) -> nn.Parameter:
        """The model parameter whose master ``master`` is (an entry of :attr:`param_groups`)."""
        return self._param_of[id(master)]

    # -- the torch.optim.Optimizer surface that k3lab uses -----------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def __repr__(self) -> str:
        kind = "split fp32 masters (bf16 p + int16 lo)" if self.master_format == "split" else "fp32 masters"
        return f"MasterWeightOptimizer({kind} of {len(self.params)} parameters, {self.optimizer!r})"

    @torch.no_grad()
    def float32_masters(self) -> list[Tensor]:
        """The fp32 masters in :attr:`masters`' order: the masters themselves (``"float32"``), or new tensors
        ``join_master(p, lo)`` (``"split"``; DTensors laid out as their parameters when these are)."""
        if self.master_format == "split":
            return [_like(join_master(local(p), local(lo)), p) for p, lo in zip(self.params, self.masters)]
        return list(self.masters)

    # -- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def sync_from_params(self) -> int:
        """Take updates made to the model's parameters outside :meth:`step` into the masters:
        ``w ← float32(p)`` where ``p ≠ bf16(w)``, for the parameters whose version counter changed
        since the last copy-back (QK-Clip). Returns how many parameters were looked at.

        ``master_format="split"``: nothing to do (returns 0): the master is ``join(p, lo)``, so a changed ``p``
        changes it, keeping its low bits (the module docstring)."""
        if self.master_format == "split":
            return 0
        changed = 0
        for i, (p, w) in enumerate(zip(self.params, self.masters)):
            if _version(p) != self._versions[i]:
                p_, w_ = local(p), local(w)
                w_.copy_(torch.where(p_ != w_.to(p_.dtype), p_.float(), w_))
                self._versions[i] = _version(p)
                changed += 1
        return changed

    @torch.no_grad()
    def grads_to_masters(self) -> list[Tensor]:
        """``w.grad = float32(p.grad)`` for every parameter (None where ``p.grad`` is None), freeing
        ``p.grad``; returns :attr:`masters` (pass them to the grad-norm clip). The unfused path: ValueError
        with ``master_format="split"``, whose int16 masters cannot hold fp32 gradients."""
        if self.master_format == "split":
            raise ValueError("MasterWeightOptimizer.grads_to_masters: TrainConfig.master_format='split' keeps its "
                             "masters as int16 low halves, which hold no fp32 gradient; it runs only the fused step "
                             "(clip_grad_norm_, then step)")
        self.sync_from_params()
        for p, w in zip(self.params, self.masters):
            w.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        return self.masters

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm: Tensor | None = None) -> Tensor:
        """The global 2-norm of the gradients (a 0-d float32 tensor, on the device) and the clip to
        ``max_norm``, as ``nn.utils.clip_grad_norm_`` computes them (``c = min(1, max_norm / (norm + 1e-6))``).
        Unfused: :meth:`grads_to_masters`, then ``nn.utils.clip_grad_norm_`` on the masters' fp32 grads.
        Fused: the norm from the bf16 gradients, accumulated in float32; ``c`` is applied inside
        :meth:`step`. ``norm``: the global norm computed elsewhere (fused only; a parallel run's, over every rank's
        shards: :func:`k3lab.parallel.fsdp.grad_norm`), used as it is, in float32."""
        if not self.fused:
            if norm is not None:
                raise ValueError("MasterWeightOptimizer.clip_grad_norm_(norm=...): the unfused path clips the "
                                 "masters' fp32 gradients itself; a given norm needs the fused step")
            return nn.utils.clip_grad_norm_(self.grads_to_masters(), max_norm)
        self.sync_from_params()
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            self._clip = None
            return torch.zeros((), device=self.masters[0].device)
        if norm is None:
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))
        norm = norm.to(torch.float32)
        self._clip = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        return norm

    @torch.no_grad()
    def prepare_fused_step(self) -> list:
        """The host half of the fused step: create the AdamW state where missing (as torch's fused AdamW does:
        ``step`` a 0-d float32 on the device), count the step on the host, group the parameters that have a
        gradient into launches (one per group and step count) and write each launch's scalars (learning rate,
        bias corrections) into its device buffer. Returns the launches for :meth:`run_fused_step`.

        With :attr:`keep_grads` the launches (their tables of addresses) are kept and reused: the gradients
        are then the same tensors every step, and a CUDA graph of :meth:`run_fused_step` replays them."""
        if self.kernel:
            from k3lab.kernels.adamw import AdamWLaunch as Launch
        else:  # the kernel's plain-PyTorch reference (the CPU)
            Launch = _ReferenceLaunch
        members_of: dict[tuple[int, int], list] = {}
        for index, group in enumerate(self.optimizer.param_groups):
            for w in group["params"]:
                p = self._param_of[id(w)]
                if p.grad is None:
                    continue
                state = self.optimizer.state[w]
                if not state:
                    self._new_state(w)
                    self._steps[id(w)] = 0
                elif id(w) not in self._steps:  # state loaded from a checkpoint: read its step once
                    self._steps[id(w)] = int(state["step"])
                self._steps[id(w)] += 1
                members_of.setdefault((index, self._steps[id(w)]), []).append((w, p, state))
        launches = []
        for (index, t), members in members_of.items():
            group = self.optimizer.param_groups[index]
            key = (index, tuple(id(w) for w, _, _ in members))
            launch = self._launches.get(key) if self.keep_grads else None
            if launch is None:
                launch = Launch([local(w) for w, _, _ in members], [local(p.grad) for _, p, _ in members],
                                [local(s["exp_avg"]) for _, _, s in members],
                                [local(s["exp_avg_sq"]) for _, _, s in members], [local(p) for _, p, _ in members],
                                local(self.masters[0]).device)
                if self.keep_grads:
                    self._launches[key] = launch
            beta1, beta2 = group["betas"]
            launch.set_scalars(adamw_scalars(float(group["lr"]), beta1, beta2, group["weight_decay"], t))
            launches.append((launch, group, [s["step"] for _, _, s in members]))
        return launches

    def _new_state(self, w: Tensor) -> dict:
        """Torch's AdamW state for the master ``w``, zero (step 0; the moments in :attr:`moment_dtype`, laid out as
        ``w``: DTensors for sharded parameters), as torch's fused AdamW makes it: ``step`` a 0-d float32."""
        state = self.optimizer.state[w]
        state.update(step=torch.zeros((), dtype=torch.float32, device=local(w).device),
                     exp_avg=torch.zeros_like(w, dtype=self.moment_dtype, memory_format=torch.preserve_format),
                     exp_avg_sq=torch.zeros_like(w, dtype=self.moment_dtype, memory_format=torch.preserve_format))
        return state

    @torch.no_grad()
    def init_state(self) -> None:
        """Zero AdamW state (step 0) for every master that has none (the fused step): what a sharded checkpoint
        is loaded into (:func:`k3lab.parallel.checkpoint.load_distributed`); the next step counts from the
        loaded step."""
        if not self.fused:
            raise ValueError("MasterWeightOptimizer.init_state: the unfused path's state is torch's AdamW's own "
                             "(built by its step)")
        for w in self.masters:
            if not self.optimizer.state[w]:
                self._new_state(w)
        self._steps.clear()  # read from the state at the next step

    @torch.no_grad()
    def run_fused_step(self, launches: list) -> None:
        """The device half of the fused step (no host work: a CUDA graph can capture it): the kernel launches
        of :meth:`prepare_fused_step` with the clip coefficient of :meth:`clip_grad_norm_` (1 if none), then
        every stepped parameter's ``step += 1``."""
        clip = self._clip if self._clip is not None else torch.ones((), device=local(self.masters[0]).device)
        for launch, group, _ in launches:
            beta1, beta2 = group["betas"]
            launch.launch(clip, beta1, beta2, group["eps"])
        steps = [t for _, _, group_steps in launches for t in group_steps]
        if steps:
            torch._foreach_add_(steps, 1.0)

    @torch.no_grad()
    def _fused_step(self) -> None:
        """Clip + AdamW + copy-back per parameter with a gradient (k3lab.kernels.adamw), on torch's AdamW state."""
        self.sync_from_params()
        self.run_fused_step(self.prepare_fused_step())
        if not self.keep_grads:
            for p in self.params:
                p.grad = None
        self._clip = None
        self._versions = [_version(p) for p in self.params]

    @torch.no_grad()
    def step(self, closure=None):
        """Step the masters with the wrapped optimizer, then copy ``bf16(w)`` into the parameters.
        Fused (see the module docstring): the parameters' bf16 gradients are consumed here, after
        :meth:`clip_grad_norm_`. Unfused: RuntimeError if a parameter still holds a gradient (call
        :meth:`grads_to_masters` or :meth:`clip_grad_norm_` first)."""
        if closure is not None:
            raise ValueError("MasterWeightOptimizer.step: closures are not supported")
        if self.fused and (self.keep_grads or any(p.grad is not None for p in self.params)):
            return self._fused_step()
        if self.master_format == "split":  # no gradient, so nothing to step (the wrapped step cannot step int16)
            return None
        if any(p.grad is not None for p in self.params):
            raise RuntimeError("MasterWeightOptimizer.step: the model's parameters still hold their gradients; "
                               "call grads_to_masters() (and clip the masters' grads) before step()")
        self.optimizer.step()
        self._copy_to_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the masters' and the parameters' gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def _copy_to_params(self) -> None:
        if self.master_format == "split":
            raise ValueError("MasterWeightOptimizer: TrainConfig.master_format='split' has no fp32 master to copy "
                             "into the parameters (they are the masters' high halves)")
        torch._foreach_copy_([local(p) for p in self.params], [local(w) for w in self.masters])  # to bf16: nearest even
        self._versions = [_version(p) for p in self.params]

    # -- checkpoints ----------------------------------------------------------------------------
    @torch.no_grad()
    def state_dict(self) -> dict:
        """The wrapped optimizer's state_dict, each parameter's state with its fp32 master under
        :data:`MASTER_KEY` (every parameter has one, stepped or not), in either format: ``"float32"``, a
        reference to the master; ``"split"``, ``join_master(p, lo)``, made one parameter at a time and moved
        to the CPU (where a checkpoint writes it), so that saving holds no fp32 copy of every master on the
        device."""
        self.sync_from_params()
        sd = self.optimizer.state_dict()
        index = {id(w): i for i, w in enumerate(w for g in self.optimizer.param_groups for w in g["params"])}
        state = {k: dict(v) for k, v in sd["state"].items()}
        for p, w in zip(self.params, self.masters):
            # a reference, as torch's own state tensors; split: the rebuilt fp32 master
            if self.master_format == "split":  # a DTensor shard stays on its device (DCP writes it from there)
                master = join_master(local(p), local(w))
                master = _like(master, p) if hasattr(p, "to_local") else master.cpu()
            else:
                master = w
            state.setdefault(index[id(w)], {})[MASTER_KEY] = master
        return {"state": state, "param_groups": sd["param_groups"]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the masters (exactly) and the wrapped optimizer's state; copy ``bf16(w)`` into the
        parameters (``"split"``: ``(p, lo) = split_master(w)``). The saved masters are fp32 in either format, so
        a state saved in one loads in the other. ValueError when a parameter's master is missing (a checkpoint
        written with ``param_dtype="float32"``) or has the wrong shape."""
        flat = [w for g in self.optimizer.param_groups for w in g["params"]]
        state = {int(k): dict(v) for k, v in state_dict["state"].items()}
        missing = [i for i in range(len(flat)) if MASTER_KEY not in state.get(i, {})]
        if missing:
            raise ValueError(f"MasterWeightOptimizer.load_state_dict: no fp32 master ({MASTER_KEY!r}) for parameters "
                             f"{missing[:8]}{'...' if len(missing) > 8 else ''}: the state was not saved with master "
                             "weights (TrainConfig.param_dtype='float32'?); resume with the param_dtype it was saved with")
        for i, w in enumerate(flat):
            master = state[i].pop(MASTER_KEY)
            if master.shape != w.shape:
                raise ValueError(f"MasterWeightOptimizer.load_state_dict: master {i} has shape {tuple(master.shape)}, "
                                 f"the parameter {tuple(w.shape)}")
            if self.master_format == "split":  # the parameter is the master's high half: written here, exactly
                p, lo = split_master(local(master).to(device=local(w).device, dtype=torch.float32))
                local(self._param_of[id(w)]).copy_(p)
                local(w).copy_(lo)
            else:
                local(w).copy_(local(master))
        self.optimizer.load_state_dict({"state": {i: s for i, s in state.items() if s},
                                        "param_groups": state_dict["param_groups"]})
        for s in self.optimizer.state.values():  # torch casts loaded state to the masters' fp32 (split: leaves the
            # saved dtype, the int16 masters not being floating point): to moment_dtype (bf16 <- fp32 of bf16: exact)
            for key in ("exp_avg", "exp_avg_sq"):
                if key in s and s[key].dtype != self.moment_dtype:
                    s[key] = s[key].to(self.moment_dtype)
        self._steps.clear()  # the fused step reads the loaded step counts
        self._launches.clear()  # their addresses were of the replaced moments
        if self.master_format == "split":
            self._versions = [_version(p) for p in self.params]
        else:
            self._copy_to_params()
