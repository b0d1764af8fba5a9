"""One fused AdamW step on float32 master weights from bf16 gradients, writing the bf16 weights back
(``TrainConfig.param_dtype="bfloat16"``: :class:`k3lab.precision.MasterWeightOptimizer` uses it on CUDA).

Per element, with ``c`` the gradient-clip coefficient (a 0-d float32 tensor on the device: no host read),
learning rate ``lr``, betas ``β1, β2``, ``ε``, weight decay ``λ`` and the parameter's step ``t``::

    g ← c · float32(ĝ)                                  ĝ: the bf16 gradient of the bf16 weight p
    w ← w · (1 − lr·λ)
    m ← β1·m + (1 − β1)·g
    v ← β2·v + (1 − β2)·g²
    w ← w − (lr / (1 − β1ᵗ)) · m / (√v / √(1 − β2ᵗ) + ε)
    p ← bf16(w)                                         round to nearest even (split masters: below)

The moments ``m, v`` are stored in float32, or in bf16 (``moment_dtype=torch.bfloat16``: 4 bytes a
parameter less, 20 bytes of traffic instead of 28): then they are read into float32, updated as above and
rounded to nearest even on the way out (as ``torch.optim.AdamW`` keeps them for bf16 parameters, fla's
setting). A bf16 moment has 8 significant bits: an update ``(1 − β)·(x − m)`` smaller than half a bf16 ulp
of ``m`` rounds away, so ``v`` follows slow drifts of ``g²`` (a few percent over ``1/(1 − β2)`` steps)
only once they add up past that; the master ``w`` stays float32.

— ``torch.optim.AdamW``'s update, in the order of operations of its fused CUDA kernel, applied to the
master ``w`` after ``w.grad = c·float32(ĝ)``. One pass: it reads ĝ, w, m, v and writes w, m, v, p
(28 bytes a parameter), where converting the gradient, clipping it, stepping and copying back are four
passes over 40 bytes a parameter. Equal to that reference path within float32 rounding (tested under
``TRITON_INTERPRET=1`` on the CPU and on CUDA).

One launch covers a whole list of tensors (a parameter group: one lr, weight decay, betas, ε and step):
each program looks up its tensor and offset in a block table, and the tensors' addresses in five int64
arrays — the multi-tensor layout of torch's ``_foreach`` kernels, which a launch per parameter (454 of
them for the ``small`` preset) would spend in host time.

Split masters (``TrainConfig.master_format="split"``, ``SPLIT``: the masters given as int16 tensors): no
float32 ``w`` is stored. The bf16 weight ``p`` is ``w``'s high half and an int16 tensor ``lo`` the rest, on
the raw bit patterns (:func:`k3lab.precision.join_master` and :func:`~k3lab.precision.split_master` are the
plain-torch reference)::

    bits(w) = (bits(p) << 16) + lo                      int32 arithmetic (mod 2³²); lo ∈ [−32768, 32767]
    w ← the update above, on that w                     the same float32 operations: the same bits
    b  = bits(w) as uint32
    hi = (b + 0x8000) >> 16                             round to nearest on the magnitude, ties away from zero
    lo ← b − (hi << 16)                                 = ((b + 0x8000) & 0xFFFF) − 0x8000
    p  ← the bf16 with bits hi                          a NaN w: p = 0x7FC0 (quiet NaN), lo = 0

The master is rebuilt exactly, so ``w``, ``m`` and ``v`` follow the float32-master update bit for bit; ``p`` is
``bf16(w)`` except at exact ties (low 16 bits 0x8000), rounded away from zero, not to even. ±inf splits
into itself and lo = 0; the largest finite float into p = ±inf, lo = −1 (still exact). NaNs become the quiet
NaN 0x7FC0 (as ``bf16_round_nearest_even`` makes them) and lo = 0: a NaN's payload is not kept — the GPU's NaN 0x7FFFFFFF has no split
with a NaN ``p`` (its nearest high half, 0x8000, is −0). Integer operations only, so the interpreter gives
the GPU's bits. Traffic: ``p`` is read too, ``lo`` replaces ``w``: 18 bytes a parameter with bf16 moments
(20 with float32 masters), 26 with float32 moments (28).

The plain-PyTorch reference of this step, element for element the same float32 operations, is
:func:`k3lab.precision.master_adamw_reference_`; :class:`~k3lab.precision.MasterWeightOptimizer` runs it where
this kernel does not (the CPU without the interpreter), e.g. on FSDP2's local shards in a gloo test.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab.kernels.rounding import DTYPES, bf16_round_nearest_even

Tensor = torch.Tensor
BLOCK = 2048  # elements per program (8 per thread at 8 warps)


@triton.jit
def _join_master(p, lo):
    """bf16 ``p`` and int16 ``lo`` -> the float32 ``w`` with ``bits(w) = (bits(p) << 16) + lo`` (int32, mod 2³²).
    ``p``'s bits sign-extended to int32 and shifted by 16 are its bits << 16 (the extension is shifted out)."""
    hi = p.to(tl.int16, bitcast=True).to(tl.int32)
    return ((hi << 16) + lo.to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def _split_master(w):
    """float32 ``w`` -> (bf16 ``p``, int16 ``lo``): ``hi = (b + 0x8000) >> 16`` (logical, on the uint32 bits ``b``),
    ``lo = b − (hi << 16)``; a NaN -> (0x7FC0, 0). ``_join_master(p, lo)`` gives ``w`` back bit for bit (not NaNs)."""
    bits = w.to(tl.uint32, bitcast=True)
    rounded = bits + 0x8000                            # wraps (mod 2³²) only for negative NaNs: replaced below
    hi = rounded >> 16                                 # uint32: a logical shift
    lo = (rounded & 0xFFFF).to(tl.int32) - 0x8000      # = b − (hi << 16), in [−32768, 32767]
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    hi = tl.where(nan, 0x7FC0, hi)
    lo = tl.where(nan, 0, lo)
    return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True), lo.to(tl.int16)


@triton.jit
def _load(ptr, offs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=mask, other=0.0)
    else:
        return tl.load(ptr + offs)


@triton.jit
def _store(ptr, offs, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, value, mask=mask)
    else:
        tl.store(ptr + offs, value)


@triton.jit
def _adamw_elements(w_ptr, g_ptr, m_ptr, v_ptr, p_ptr, offs, mask, clip, decay, beta1, beta2, eps, step_size,
                    bc2_sqrt, MOMENTS_BF16: tl.constexpr, SPLIT: tl.constexpr, MASKED: tl.constexpr):
    """The update of the module docstring on the elements ``offs`` of one tensor (``mask``: those < numel).
    ``SPLIT``: ``w_ptr`` points at the int16 low halves ``lo``, and ``w = join(p, lo)``."""
    g = _load(g_ptr, offs, mask, MASKED).to(tl.float32) * clip
    if SPLIT:
        w = _join_master(_load(p_ptr, offs, mask, MASKED), _load(w_ptr, offs, mask, MASKED)) * decay
    else:
        w = _load(w_ptr, offs, mask, MASKED) * decay
    m = beta1 * _load(m_ptr, offs, mask, MASKED).to(tl.float32) + (1.0 - beta1) * g
    v = beta2 * _load(v_ptr, offs, mask, MASKED).to(tl.float32) + (1.0 - beta2) * g * g
    if MOMENTS_BF16:  # the stored moments are what the next step reads: round them first, as torch does
        m = bf16_round_nearest_even(m).to(tl.float32)
        v = bf16_round_nearest_even(v).to(tl.float32)
    w = w - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    if SPLIT:
        p, lo = _split_master(w)
        _store(w_ptr, offs, lo, mask, MASKED)
        _store(p_ptr, offs, p, mask, MASKED)
    else:
        _store(w_ptr, offs, w, mask, MASKED)
        _store(p_ptr, offs, bf16_round_nearest_even(w), mask, MASKED)
    if MOMENTS_BF16:
        _store(m_ptr, offs, m.to(tl.bfloat16), mask, MASKED)  # exact: m is a bf16 value already
        _store(v_ptr, offs, v.to(tl.bfloat16), mask, MASKED)
    else:
        _store(m_ptr, offs, m, mask, MASKED)
        _store(v_ptr, offs, v, mask, MASKED)


@triton.jit
def _master_adamw_kernel(addresses, numels, block_tensor, block_start, clip_ptr, hyper_ptr, n_tensors, beta1, beta2,
                         eps, BLOCK: tl.constexpr, MOMENTS_BF16: tl.constexpr, SPLIT: tl.constexpr,
                         ALIGNED: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)                 # which tensor this block belongs to
    start = tl.multiple_of(tl.load(block_start + pid), BLOCK)  # int64, a multiple of BLOCK
    offs = start + tl.arange(0, BLOCK)              # element offsets in the tensor
    numel = tl.load(numels + t)
    if SPLIT:  # rows of [5, n_tensors]; the first: the masters (float32 w, or the split format's int16 lo)
        w_ptr = tl.load(addresses + t).to(tl.pointer_type(tl.int16))
    else:
        w_ptr = tl.load(addresses + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(addresses + n_tensors + t).to(tl.pointer_type(tl.bfloat16))
    if MOMENTS_BF16:
        m_ptr = tl.load(addresses + 2 * n_tensors + t).to(tl.pointer_type(tl.bfloat16))
        v_ptr = tl.load(addresses + 3 * n_tensors + t).to(tl.pointer_type(tl.bfloat16))
    else:
        m_ptr = tl.load(addresses + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(addresses + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
    p_ptr = tl.load(addresses + 4 * n_tensors + t).to(tl.pointer_type(tl.bfloat16))
    if ALIGNED:  # every address 16-byte aligned (checked on the host): 16-byte vector loads and stores
        w_ptr = tl.multiple_of(w_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        p_ptr = tl.multiple_of(p_ptr, 16)
    clip = tl.load(clip_ptr)
    decay = tl.load(hyper_ptr)            # the step's scalars, read on the device (a CUDA graph replays this launch)
    step_size = tl.load(hyper_ptr + 1)
    bc2_sqrt = tl.load(hyper_ptr + 2)
    if start + BLOCK <= numel:  # a full block: no mask, so the loads vectorize
        _adamw_elements(w_ptr, g_ptr, m_ptr, v_ptr, p_ptr, offs, offs, clip, decay, beta1, beta2, eps, step_size,
                        bc2_sqrt, MOMENTS_BF16, SPLIT, False)
    else:                       # a tensor's last, partial block
        _adamw_elements(w_ptr, g_ptr, m_ptr, v_ptr, p_ptr, offs, offs < numel, clip, decay, beta1, beta2, eps,
                        step_size, bc2_sqrt, MOMENTS_BF16, SPLIT, True)


MASTER_DTYPES = (torch.float32, torch.int16)     # the masters: float32 w, or the split format's int16 low halves


def _roles(master_dtype: torch.dtype, moment_dtype: torch.dtype) -> tuple[tuple[str, torch.dtype], ...]:
    """(name, dtype) of the five tensor lists, in the kernel's order."""
    return (("master", master_dtype), ("grad", torch.bfloat16), ("exp_avg", moment_dtype),
            ("exp_avg_sq", moment_dtype), ("param", torch.bfloat16))
_block_tables: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}  # (device, numels) -> (numels, block_tensor, block_start)


def _block_table(device: torch.device, numels: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """``numels [n]`` int64, and per program ``block_tensor`` (int32) and ``block_start`` (int64), cached
    per device and list of sizes (a parameter group's sizes do not change)."""
    key = (device, numels)
    if key not in _block_tables:
        blocks = [triton.cdiv(n, BLOCK) for n in numels]
        tensor_of = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), torch.tensor(blocks))
        first = torch.tensor([0] + blocks[:-1]).cumsum(0).repeat_interleave(torch.tensor(blocks))  # [blocks]
        start = (torch.arange(int(sum(blocks))) - first) * BLOCK
        _block_tables[key] = (torch.tensor(numels, dtype=torch.int64).to(device), tensor_of.to(device),
                              start.to(device))
    return _block_tables[key]


class AdamWLaunch:
    """One kernel launch over fixed lists of tensors: the block table and the five rows of addresses, built
    once (``master_adamw_step_`` builds one per call; :class:`k3lab.precision.MasterWeightOptimizer` keeps
    them while the gradients stay the same tensors, so that a CUDA graph can replay the launch).

    ``hyper`` is the launch's device buffer of :func:`k3lab.precision.adamw_scalars`; :meth:`set_scalars` writes it from the
    host (stream-ordered), :meth:`launch` only reads it. Masters given as int16 tensors are the split format's
    low halves ``lo`` (the module docstring): the launch then rebuilds ``w`` from ``params`` and them.
    """

    def __init__(self, masters: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                 params: list[Tensor], device: torch.device):
        lists = (masters, grads, exp_avgs, exp_avg_sqs, params)
        if len({len(x) for x in lists}) != 1:
            raise ValueError(f"master_adamw_step_: the five lists must have one length, got {[len(x) for x in lists]}")
        moment_dtype = exp_avgs[0].dtype if exp_avgs and exp_avgs[0].dtype in DTYPES else torch.float32
        master_dtype = masters[0].dtype if masters and masters[0].dtype in MASTER_DTYPES else torch.float32
        roles = _roles(master_dtype, moment_dtype)
        shapes = [w.shape for w in masters]
        fine = all({(t.dtype, t.device) for t in x} <= {(dtype, device)} and [t.shape for t in x] == shapes
                   and all(t.is_contiguous() for t in x) for x, (_, dtype) in zip(lists, roles))
        for i, tensors in enumerate(() if fine else zip(*lists)):  # the slow look only to name what is wrong
            for (name, dtype), t in zip(roles, tensors):
                if t.shape != tensors[0].shape or t.dtype != dtype or not t.is_contiguous() or t.device != device:
                    raise ValueError(f"master_adamw_step_: {name}s[{i}] must be a contiguous {dtype} tensor of shape "
                                     f"{tuple(tensors[0].shape)} on {device}, got {t.dtype} {tuple(t.shape)} on "
                                     f"{t.device}{'' if t.is_contiguous() else ' (not contiguous)'}")
        numels = tuple(w.numel() for w in masters)
        self.n, self.empty, self.moments_bf16 = len(masters), sum(numels) == 0, moment_dtype == torch.bfloat16
        self.split = master_dtype == torch.int16
        self.hyper = torch.zeros(3, dtype=torch.float32, device=device)  # [decay, step_size, bc2_sqrt]
        if self.empty:
            return
        self.sizes, self.block_tensor, self.block_start = _block_table(device, numels)
        pointers = [[t.data_ptr() for t in x] for x in lists]
        self.aligned = all(a % 16 == 0 for row in pointers for a in row)
        self.addresses = torch.tensor(pointers, dtype=torch.int64).to(device)  # [5, n]

    def set_scalars(self, scalars: tuple[float, float, float]) -> None:
        """Write the step's three scalars (:func:`k3lab.precision.adamw_scalars`, computed by the caller) into
        ``hyper`` (a host-to-device copy on the current stream)."""
        self.hyper.copy_(torch.tensor(scalars, dtype=torch.float32))

    def launch(self, clip: Tensor, beta1: float, beta2: float, eps: float) -> None:
        """The update on every tensor of the lists, with the scalars in ``hyper`` and the clip coefficient ``clip``."""
        if clip.numel() != 1 or clip.dtype != torch.float32:
            raise ValueError(f"master_adamw_step_: clip must be a one-element float32 tensor, got {clip.dtype} "
                             f"{tuple(clip.shape)}")
        if self.empty:
            return
        _master_adamw_kernel[(self.block_tensor.numel(),)](
            self.addresses, self.sizes, self.block_tensor, self.block_start, clip, self.hyper, self.n, beta1, beta2,
            eps, BLOCK=BLOCK, MOMENTS_BF16=self.moments_bf16, SPLIT=self.split, ALIGNED=self.aligned, num_warps=8)


def master_adamw_step_(masters: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                       params: list[Tensor], clip: Tensor, *, scalars: tuple[float, float, float], beta1: float,
                       beta2: float, eps: float) -> None:
    """The update of the module docstring for every tensor of the lists, in place on ``masters``,
    ``exp_avgs``, ``exp_avg_sqs`` (float32) and ``params`` (bf16), from ``grads`` (bf16) and ``clip``
    (0-d float32), in one launch; ``scalars``: :func:`k3lab.precision.adamw_scalars` of the step (t counted from 1,
    the same for all).

    The five tensors of each index must have one shape, be contiguous and on ``clip``'s device, the
    moments all float32 or all bf16, the masters all float32 or all int16 (the split format's ``lo``:
    ``params`` then hold the masters' high halves) (ValueError naming the list and index otherwise).
    """
    plan = AdamWLaunch(masters, grads, exp_avgs, exp_avg_sqs, params, clip.device)
    plan.set_scalars(scalars)
    plan.launch(clip, beta1, beta2, eps)
