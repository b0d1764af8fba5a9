"""MXFP4 weights as the released K3 stores its routed experts: compressed-tensors' ``mxfp4-pack-quantized``.

A weight ``W [m, n]`` (n a multiple of 32) is cut into groups of 32 along its input dimension; group g
of row r shares one power-of-two scale::

    W[r, 32g + j] = 2^(s_rg − 127) · q_r,32g+j        q ∈ E2M1 = {±0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6}

and is stored as two uint8 tensors::

    weight_packed [m, n/2]   two E2M1 codes per byte: element 2j in the low nibble, 2j+1 in the high one;
                             code = sign (bit 3) | index into (0, 0.5, 1, 1.5, 2, 3, 4, 6) (bits 0-2)
    weight_scale  [m, n/32]  the shared exponent s_rg (E8M0: 2^(s − 127))

Quantizing sets ``2^(s−127)`` = (the group's absmax rounded to a power of two) / 4, 4 = 2^⌊log2 6⌋, and
rounds ``W / 2^(s−127)`` to the nearest E2M1 value, clamped to ±6. Both directions run in the
``compressed-tensors`` package (``MXFP4PackedCompressor``, the code that wrote the release);
:func:`dequantize_reference` is the plain-PyTorch reading of the equation above, kept as an independent
check for the tests. Dequantized values are exact in bf16 (a 2-bit mantissa times a power of two).

``compressed_tensors`` (which imports transformers: seconds) and torch are imported inside the functions
that need them, so ``import k3lab.hf.config`` (which uses :func:`check_quantization_config`, plain dict
checking) stays light.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import Tensor

QUANT_METHOD = "compressed-tensors"  # quantization_config.quant_method of the release
FORMAT = "mxfp4-pack-quantized"  # quantization_config.format (and each config group's format)
GROUP_SIZE = 32  # elements sharing one scale
PACKED_SUFFIXES = ("weight_packed", "weight_scale")  # the two stored tensors of one MXFP4 weight
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of the 3-bit index
# what a config group's `weights` must say for k3lab to read it (field -> allowed values)
WEIGHT_ARGS = {"num_bits": (4,), "type": ("float",), "symmetric": (True,), "group_size": (GROUP_SIZE,),
               "strategy": ("group",), "dynamic": (False,), "scale_dtype": ("torch.uint8", "uint8")}


# ----------------------------------------------------------------------------------------------
# quantization_config (config.json)
# ----------------------------------------------------------------------------------------------
def check_quantization_config(qc: dict, where: str = "config.json") -> None:
    """Refuse a ``quantization_config`` that asks for anything but MXFP4 weights (A16).

    Accepted: ``quant_method`` "compressed-tensors", ``format`` "mxfp4-pack-quantized" (or "mixed-precision"
    with every group in that format), every config group's ``weights`` as :data:`WEIGHT_ARGS`, no
    ``input_activations`` / ``output_activations`` quantization (k3lab runs activations in bf16/fp32), no
    ``kv_cache_scheme``, no ``sparsity_config``. Raises ValueError naming ``where``, the field and the
    allowed values.
    """
    def fail(field: str, value, allowed) -> None:
        raise ValueError(f"{where}: quantization_config.{field}={value!r}: k3lab reads compressed-tensors MXFP4 "
                         f"weights only (allowed: {allowed})")

    if not isinstance(qc, dict):
        fail("", qc, "a dict")
    if qc.get("quant_method") != QUANT_METHOD:
        fail("quant_method", qc.get("quant_method"), (QUANT_METHOD,))
    top_format = qc.get("format", FORMAT)
    if top_format not in (FORMAT, "mixed-precision"):
        fail("format", top_format, (FORMAT, "mixed-precision"))
    for key in ("kv_cache_scheme", "sparsity_config"):
        if qc.get(key) not in (None, {}):
            fail(key, qc[key], (None,))
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        fail("config_groups", groups, "a non-empty dict of schemes")
    for name, group in groups.items():
        if not isinstance(group, dict):
            fail(f"config_groups.{name}", group, "a scheme dict")
        fmt = group.get("format") or top_format
        if fmt != FORMAT:
            fail(f"config_groups.{name}.format", fmt, (FORMAT,))
        for key in ("input_activations", "output_activations"):
            if group.get(key) is not None:
                fail(f"config_groups.{name}.{key}", group[key], (None,))
        weights = group.get("weights")
        if not isinstance(weights, dict):
            fail(f"config_groups.{name}.weights", weights, "a dict of quantization args")
        for key, allowed in WEIGHT_ARGS.items():
            required = key in ("num_bits", "type", "group_size")
            if key not in weights and not required:
                continue
            value = weights.get(key)
            if key == "scale_dtype" and value is not None:
                value = str(value)
            if value not in allowed:
                fail(f"config_groups.{name}.weights.{key}", weights.get(key), allowed)


def quantization_config(ignore: list[str]) -> dict:
    """The ``quantization_config`` a checkpoint with MXFP4 weights carries (the release's scheme):
    compressed-tensors, one group targeting ``Linear``, weights MXFP4 group 32 with uint8 scales,
    activations unquantized; ``ignore`` lists the Linear modules kept in bf16."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    qc = QuantizationConfig(config_groups={"group_0": scheme()}, quant_method=QUANT_METHOD, format=FORMAT,
                            ignore=list(ignore), quantization_status=QuantizationStatus.COMPRESSED)
    return qc.model_dump(mode="json")


def scheme(config_group: dict | None = None):
    """compressed-tensors' ``QuantizationScheme`` for MXFP4 weights: the preset ``MXFP4A16`` targeting
    ``Linear``, or ``config_group`` (a checked group of a checkpoint's quantization_config) parsed by it."""
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    if config_group is not None:
        s = QuantizationScheme.model_validate(config_group)
    else:
        s = preset_name_to_scheme("MXFP4A16", ["Linear"])
    s.format = FORMAT
    return s


# ----------------------------------------------------------------------------------------------
# quantize / dequantize (compressed-tensors)
# ----------------------------------------------------------------------------------------------
def _check_2d(w: Tensor, name: str) -> tuple[int, int]:
    if w.dim() != 2 or w.shape[1] % GROUP_SIZE != 0:
        raise ValueError(f"{name}: MXFP4 needs a 2-D weight [m, n] with n a multiple of {GROUP_SIZE}, "
                         f"got shape {tuple(w.shape)}")
    return tuple(w.shape)


def quantize(w: Tensor, name: str = "weight") -> tuple[Tensor, Tensor]:
    """``W [m, n]`` (float) -> ``(weight_packed [m, n/2] uint8, weight_scale [m, n/32] uint8)`` with
    compressed-tensors: scales from its MX observer math (``compute_dynamic_scales_and_zp``), packing by
    ``MXFP4PackedCompressor.compress``."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    _check_2d(w, name)
    s = scheme()
    scale, zero_point = compute_dynamic_scales_and_zp(w, s.weights, None)  # [m, n/32] powers of two, w's dtype
    out = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, s)
    return out["weight_packed"], out["weight_scale"]


def dequantize(packed: Tensor, scale: Tensor, dtype: torch.dtype | None = None, name: str = "weight",
               quant_scheme=None) -> Tensor:
    """``(weight_packed [m, n/2] uint8, weight_scale [m, n/32] uint8) -> W [m, n]`` in ``dtype`` (None: bf16)
    with compressed-tensors' ``MXFP4PackedCompressor.decompress`` (bf16 result, exact, then cast).
    ``quant_scheme``: the checkpoint's :func:`scheme` (default: the MXFP4A16 preset)."""
    import torch
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor

    check_packed(packed, scale, name)
    out = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale},
                                           quant_scheme if quant_scheme is not None else scheme())
    return out["weight"].to(dtype if dtype is not None else torch.bfloat16)


def round_trip(w: Tensor) -> Tensor:
    """compressed-tensors' own quantize -> dequantize of ``W`` (``fake_quantize`` with the same scales):
    the values an MXFP4 checkpoint written from ``W`` must load as. Same shape and dtype as ``w``."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    _check_2d(w, "weight")
    s = scheme()
    scale, zero_point = compute_dynamic_scales_and_zp(w, s.weights, None)
    return fake_quantize(w, scale, zero_point, s.weights)


def check_packed(packed: Tensor, scale: Tensor, name: str = "weight") -> None:
    """ValueError naming ``name`` unless packed is ``[m, n/2]`` uint8 and scale ``[m, n/32]`` uint8."""
    import torch

    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"{name}: weight_packed / weight_scale must be uint8, got {packed.dtype} / {scale.dtype}")
    if packed.dim() != 2 or scale.dim() != 2 or scale.shape[0] != packed.shape[0] \
            or 2 * packed.shape[1] != GROUP_SIZE * scale.shape[1]:
        raise ValueError(f"{name}: weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} do not "
                         f"describe one [m, n] weight (need [m, n/2] and [m, n/{GROUP_SIZE}])")


def packed_shapes(shape: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Stored shapes ``(weight_packed, weight_scale)`` of an MXFP4 weight of ``shape`` [m, n]."""
    m, n = shape
    return (m, n // 2), (m, n // GROUP_SIZE)


# ----------------------------------------------------------------------------------------------
# the plain reference
# ----------------------------------------------------------------------------------------------
def dequantize_reference(packed: Tensor, scale: Tensor) -> Tensor:
    """The equation of the module docstring in plain PyTorch, fp32: ``W[r, 32g+j] = 2^(s_rg−127) · E2M1(code)``."""
    import torch

    check_packed(packed, scale)
    m = packed.shape[0]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(m, -1)        # [m, n] element 2j low nibble
    magnitude = torch.tensor(E2M1_VALUES)[(codes & 0x07).long()]                   # [m, n]
    q = torch.where((codes & 0x08) != 0, -magnitude, magnitude)                     # [m, n] E2M1 values
    step = torch.pow(2.0, scale.to(torch.float32) - 127.0)                          # [m, n/32]
    return q * step.repeat_interleave(GROUP_SIZE, dim=1)                            # [m, n]
