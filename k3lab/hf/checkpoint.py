"""Hugging Face checkpoints of both families: read any slice of one, and write ours the same way.

Two layouts (docs/hf_checkpoint.md), chosen by the family of ``config.json`` (:func:`k3lab.hf.config.hf_family`)
when reading and by the model's config (:func:`k3lab.hf.config.config_family`) when writing:

* **K3** (the release), described below;
* **Kimi Linear** (what transformers' ``KimiLinearForCausalLM.save_pretrained`` writes): k3lab's state-dict
  names with no prefix, routed experts per expert as in K3, ``self_attn.A_log`` stored ``[1, 1, H, 1]``, and
  the dense first layer's MLP stored as ``mlp.*`` or ``block_sparse_moe.*`` (transformers writes the second,
  k3lab's writer too), and ``lm_head.weight`` stored even under ``tie_word_embeddings`` (transformers'
  ``KimiLinearForCausalLM`` never ties: k3lab writes a copy of the embedding, and reads a stored head only
  where it equals the embedding). Written with transformers' ``config.json`` (``model_type`` "kimi_linear"), so that
  ``AutoModelForCausalLM.from_pretrained`` loads it with no missing or unexpected key. That is transformers'
  "original" format (``save_pretrained``'s default); its "internal" one (``save_original_format=False``: the
  names of its modules) fuses the short convs into ``self_attn.conv1d.weight [3·H·K, 1, W]`` and the experts
  into ``mlp.experts.gate_up_proj [E, 2·I, D]`` / ``down_proj [E, D, I]``, puts the decay parameters under
  ``self_attn.forget_gate.`` and the MoE under ``mlp.`` (:func:`internal_part`). Both are read (the format
  decided by the names present, :func:`detect_kimi_linear_format`) and written (``kimi_linear_format``).

The K3 release's layout:

A checkpoint directory (docs/hf_checkpoint.md)::

    config.json                        k3lab.hf.config.to_hf_config(cfg) (+ quantization_config when weights are MXFP4)
    model.safetensors.index.json       {"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}}
    model-00001-of-0000N.safetensors   the shards (a lone model.safetensors without an index is read too)

Tensor names are ``language_model.`` + k3lab's state-dict name (the prefix is optional when reading), except:

* routed experts, stacked in k3lab as ``experts.w1 / w3 [E, I, L]`` and ``experts.w2 [E, L, I]``, are stored per
  expert: ``experts.{e}.w1.weight [I, L]`` — or, MXFP4 (:mod:`k3lab.hf.mxfp4`), ``experts.{e}.w1.weight_packed
  [I, L/2]`` + ``weight_scale [I, L/32]`` (uint8), dequantized on load with compressed-tensors;
* ``self_attn.A_log`` of H heads is stored ``[H]`` or padded ``[P > H]`` (the release: [128] for 96 heads);
  the first H entries are the heads';
* ``lm_head.weight`` is absent when ``tie_word_embeddings`` (the reader accepts one equal to the embedding).

Stored dtypes follow the release: float32 for :data:`FP32_SUFFIXES` (short-conv weights, ``dt_bias``, ``A_log``,
``o_norm``, the router's ``e_score_correction_bias``), bf16 (the writer's ``dtype``) for the rest.

:func:`load_hf_checkpoint` builds the model on the meta device and materialises only what was asked for
(``layers=[1]``, ``embeddings``, ``head``, ``routed_experts``): those parameters are created from the stored
tensors, read lazily shard by shard (``safetensors.safe_open``); everything else stays on meta, so nothing
is left at a random init. A missing, extra or wrongly shaped tensor, a missing or unreadable shard, a missing
index, a config for another architecture or an unknown quantization format is a ValueError naming the file
and the tensor or field.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm import tqdm

from k3lab.config import ModelConfig
from k3lab.hf import mxfp4
from k3lab.hf.config import FAMILIES, config_family, from_hf_config, hf_family, load_json, to_hf_config
from k3lab.model import K3ForCausalLM
from k3lab.moe.latent import LatentMoE
from k3lab.moe.router import make_balancer

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"  # a one-shard checkpoint without an index
PREFIX = "language_model."  # the release's prefix of the text model (multimodal wrapper)
SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
DEFAULT_SHARD_BYTES = 5 * 2**30
# stored float32 in the release, whatever the rest's dtype
FP32_SUFFIXES = ("_conv1d.weight", "self_attn.dt_bias", "self_attn.A_log", "self_attn.o_norm.weight",
                 "gate.e_score_correction_bias")
EXPERT_PARAM = re.compile(r"^(?P<base>.*\.experts)\.(?P<w>w[123])$")  # k3lab's stacked expert weights
HEAD_PREFIXES = ("lm_head.", "model.norm.", "model.output_attn_res_", "mtp.")  # what head=True loads
EMBED_PREFIX = "model.embed_tokens."
DENSE_MLP = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.(?P<rest>.*)$")  # k3lab's dense MLP (first layers)
KIMI_LINEAR_DENSE = "block_sparse_moe"  # where transformers' save_pretrained puts the dense MLP (its reverse rename)
# transformers' two Kimi Linear formats: save_pretrained(save_original_format=True) (its default) / =False
KIMI_LINEAR_FORMATS = ("original", "internal")
# names only one of the two formats has (a checkpoint holding both kinds is refused)
ORIGINAL_ONLY = re.compile(r"\.self_attn\.([qkv]_conv1d\.weight|f_[ab]_proj\.weight|dt_bias|A_log)$"
                           r"|\.block_sparse_moe\.|\.experts\.\d+\.w[123]\.")
INTERNAL_ONLY = re.compile(r"\.self_attn\.(conv1d\.weight|forget_gate\.)|\.mlp\.(experts|gate|shared_experts)\.")
INTERNAL_CONV = re.compile(r"^(?P<attn>.*\.self_attn)\.(?P<qkv>[qkv])_conv1d\.weight$")
INTERNAL_FORGET = re.compile(r"^(?P<attn>.*\.self_attn)\.(?P<rest>f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$")
INTERNAL_MOE = re.compile(r"^(?P<layer>.*)\.block_sparse_moe\.(?P<rest>.*)$")


@dataclass(frozen=True)
class Part:
    """Where a k3lab parameter is stored: all of tensor ``stored``, or (``fused_shape`` given) the ``length``
    entries from ``start`` along ``axis`` of a fused tensor of that shape."""

    stored: str
    fused_shape: tuple[int, ...] | None = None
    axis: int = 0
    start: int = 0
    length: int = 0
    what: str = ""  # how the fused tensor is built, for errors


def internal_part(name: str, shape: tuple[int, ...]) -> Part:
    """Where k3lab parameter ``name`` of ``shape`` lies in transformers' internal Kimi Linear format
    (``save_pretrained(save_original_format=False)``; names without prefix)."""
    m = INTERNAL_CONV.match(name)
    if m is not None:  # q, k, v short convs [H·K, 1, W] -> conv1d [3·H·K, 1, W]
        n = shape[0]
        return Part(f"{m['attn']}.conv1d.weight", (3 * n, *shape[1:]), 0, "qkv".index(m["qkv"]) * n, n,
                    f"the q, k, v short convs {list(shape)} concatenated on axis 0")
    m = INTERNAL_FORGET.match(name)
    if m is not None:
        return Part(f"{m['attn']}.forget_gate.{m['rest']}")
    m = INTERNAL_MOE.match(name)
    if m is None:
        return Part(name)
    if m["rest"] in ("experts.w1", "experts.w3"):  # gate w1, up w3 [E, I, D] -> gate_up_proj [E, 2·I, D]
        E, I, D = shape
        return Part(f"{m['layer']}.mlp.experts.gate_up_proj", (E, 2 * I, D), 1, 0 if m["rest"] == "experts.w1" else I,
                    I, f"the experts' gate w1 and up w3 {list(shape)} concatenated on axis 1")
    if m["rest"] == "experts.w2":  # [E, D, I], as k3lab stacks it
        return Part(f"{m['layer']}.mlp.experts.down_proj")
    return Part(f"{m['layer']}.mlp.{m['rest']}")


def detect_kimi_linear_format(names, source: str) -> str:
    """"original" or "internal": which of transformers' Kimi Linear formats the stored ``names`` are in, from
    the names only one of them has; a checkpoint holding names of both is a ValueError naming one of each. With
    none of those names (no KDA layer, no MoE) the two formats read the same and "original" is returned."""
    names = sorted(names)
    original = next((n for n in names if ORIGINAL_ONLY.search(n)), None)
    internal = next((n for n in names if INTERNAL_ONLY.search(n)), None)
    if original is not None and internal is not None:
        raise ValueError(f"{source}: {internal} is transformers' internal Kimi Linear format "
                         f"(save_original_format=False) and {original} its original format; a checkpoint must use one")
    return "internal" if internal is not None else "original"


def stored_name(name: str, family: str, prefix: str = "") -> str:
    """The stored name of k3lab parameter ``name`` (not a stacked expert weight) in ``family``'s layout."""
    m = DENSE_MLP.match(name)
    if family == "kimi_linear" and m is not None:
        return f"{prefix}{m['layer']}.{KIMI_LINEAR_DENSE}.{m['rest']}"
    return prefix + name


def stored_names(name: str, family: str, prefix: str = "") -> list[str]:
    """Every stored name the reader accepts for ``name``: Kimi Linear's dense MLP under ``mlp.`` or
    ``block_sparse_moe.``; one name otherwise."""
    names = [stored_name(name, family, prefix)]
    if names[0] != prefix + name:
        names.append(prefix + name)
    return names


def _bar(iterable=None, **kwargs):
    """Text tqdm on stdout over tensors (a saved notebook keeps the finished bar; one redraw a second there)."""
    return tqdm(iterable, unit="tensor", file=sys.stdout, mininterval=0.1 if sys.stdout.isatty() else 1.0, **kwargs)


def stored_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the release stores k3lab parameter ``name`` in: float32 for :data:`FP32_SUFFIXES`, else ``dtype``."""
    return torch.float32 if name.endswith(FP32_SUFFIXES) else dtype


# ----------------------------------------------------------------------------------------------
# writer
# ----------------------------------------------------------------------------------------------
@dataclass
class _Unit:
    """Tensors written together (one MXFP4 weight is two tensors): names, shapes, dtypes and a producer."""

    names: list[str]
    shapes: list[tuple]
    dtypes: list[torch.dtype]
    make: object  # () -> list[Tensor], in the order of names

    @property
    def nbytes(self) -> int:
        return sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                   for s, d in zip(self.shapes, self.dtypes))


def _expert_unit(hf_base: str, weight: Tensor, dtype: torch.dtype, quantize: bool) -> _Unit:
    """One expert matrix ``weight [a, b]`` under ``hf_base`` (e.g. ``...experts.3.w1``): bf16 or MXFP4."""
    shape = tuple(weight.shape)
    if not quantize:
        return _Unit([f"{hf_base}.weight"], [shape], [dtype], lambda: [weight.to(dtype).contiguous().clone()])
    packed_shape, scale_shape = mxfp4.packed_shapes(shape)
    return _Unit([f"{hf_base}.weight_packed", f"{hf_base}.weight_scale"], [packed_shape, scale_shape],
                 [torch.uint8, torch.uint8], lambda: list(mxfp4.quantize(weight.to(dtype), name=f"{hf_base}.weight")))


def _plan(model: K3ForCausalLM, dtype: torch.dtype | None, quantize: bool, a_log_padded_to: int | None,
          prefix: str, layers: set[int] | None = None, family: str = "k3",
          kimi_linear_format: str = "original") -> list[_Unit]:
    """The units to write, in state-dict order (``layers``: only those decoder layers, for inspection)."""
    cfg = model.config
    state = model.state_dict()
    internal = family == "kimi_linear" and kimi_linear_format == "internal"
    fused: dict[str, list[tuple[int, str]]] = {}  # internal format: fused stored name -> [(start, k3lab name)]
    if internal:
        for name, value in state.items():
            part = internal_part(name, tuple(value.shape))
            if part.fused_shape is not None:
                fused.setdefault(part.stored, []).append((part.start, name))
    units = []
    for name, value in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings and family != "kimi_linear":
            continue  # the embedding's tensor (K3's release layout); transformers' Kimi Linear never ties, so
            # that layout stores the head, a copy of the embedding, which from_pretrained loads
        if layers is not None and name.startswith("model.layers.") and int(name.split(".")[2]) not in layers:
            continue
        want = stored_dtype(name, dtype if dtype is not None else value.dtype)
        if internal:
            part = internal_part(name, tuple(value.shape))
            shape = part.fused_shape or tuple(value.shape)
            if name.endswith("self_attn.A_log"):
                shape = (1, 1, value.numel(), 1)                                    # transformers' A_log
            if part.fused_shape is not None:
                pieces = [n for _, n in sorted(fused[part.stored])]
                if pieces[0] != name:
                    continue  # written with the first piece
                def concat(ns=pieces, d=want, axis=part.axis):
                    return [torch.cat([state[n].to(d) for n in ns], dim=axis).contiguous()]
                units.append(_Unit([prefix + part.stored], [shape], [want], concat))
            else:
                units.append(_Unit([prefix + part.stored], [shape], [want],
                                   lambda v=value, d=want, s=shape: [v.to(d).reshape(s).contiguous().clone()]))
            continue
        m = EXPERT_PARAM.match(name)
        if m is not None:
            for e in range(value.shape[0]):
                units.append(_expert_unit(f"{prefix}{m['base']}.{e}.{m['w']}", value[e], want, quantize))
            continue
        if name.endswith("self_attn.A_log") and a_log_padded_to is not None:
            if a_log_padded_to < value.numel():
                raise ValueError(f"a_log_padded_to={a_log_padded_to}: must be >= the KDA heads ({value.numel()})")
            def padded(v=value, n=a_log_padded_to, d=want):
                out = torch.zeros(n, dtype=d)                                       # [P], zeros past the H heads
                out[:v.numel()] = v
                return [out]
            units.append(_Unit([prefix + name], [(a_log_padded_to,)], [want], padded))
            continue
        if name.endswith("self_attn.A_log") and family == "kimi_linear":  # transformers' [1, 1, H, 1]
            shape = (1, 1, value.numel(), 1)
            units.append(_Unit([prefix + name], [shape], [want],
                               lambda v=value, d=want, s=shape: [v.to(d).reshape(s).contiguous().clone()]))
            continue
        units.append(_Unit([stored_name(name, family, prefix)], [tuple(value.shape)], [want],
                           lambda v=value, d=want: [v.to(d).contiguous().clone()]))
    return units


def tensor_specs(model: K3ForCausalLM, *, dtype: torch.dtype | None = torch.bfloat16, mxfp4_experts: bool = False,
                 a_log_padded_to: int | None = None, prefix: str | None = None, layers=None,
                 family: str | None = None, kimi_linear_format: str = "original"
                 ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{stored name: (shape, dtype)}`` that :func:`save_hf_checkpoint` would write for ``model`` (which may be
    on the meta device: nothing is computed), restricted to decoder ``layers`` when given."""
    family, prefix = _layout(model.config, family, prefix, mxfp4_experts, a_log_padded_to, kimi_linear_format)
    keep = None if layers is None else set(_parse_layers(layers, model.config.num_hidden_layers))
    return {name: (shape, dt) for unit in _plan(model, dtype, mxfp4_experts, a_log_padded_to, prefix, keep, family,
                                                kimi_linear_format)
            for name, shape, dt in zip(unit.names, unit.shapes, unit.dtypes)}


def _layout(cfg: ModelConfig, family: str | None, prefix: str | None, mxfp4_experts: bool,
            a_log_padded_to: int | None, kimi_linear_format: str = "original") -> tuple[str, str]:
    """(family, prefix) of a checkpoint to write: the config's family unless given; K3's ``language_model.``
    prefix, none for Kimi Linear (transformers reads no other)."""
    family = config_family(cfg) if family is None else family
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: allowed values are {FAMILIES}")
    if kimi_linear_format not in KIMI_LINEAR_FORMATS:
        raise ValueError(f"kimi_linear_format={kimi_linear_format!r}: allowed values are {KIMI_LINEAR_FORMATS}")
    if family != "kimi_linear" and kimi_linear_format != "original":
        raise ValueError(f"kimi_linear_format={kimi_linear_format!r}: only the Kimi Linear layout "
                         f"(family='kimi_linear') has transformers' internal format; this is family={family!r}")
    if family == "kimi_linear":
        for flag, value in (("mxfp4_experts", mxfp4_experts), ("a_log_padded_to", a_log_padded_to),
                            ("prefix", prefix or None)):
            if value:
                raise ValueError(f"{flag}={value!r}: the Kimi Linear layout (transformers' KimiLinearForCausalLM) "
                                 "has no such option; it is K3's release layout (family='k3')")
        return family, ""
    return family, PREFIX if prefix is None else prefix


def _bf16_ignore(prefix: str) -> list[str]:
    """compressed-tensors ``ignore`` entries: every Linear of k3lab's text model except the routed experts."""
    return [f"{prefix}lm_head", r"re:.*self_attn\..*", r"re:.*shared_experts\..*", r"re:.*\.mlp\..*_proj$",
            r"re:.*block_sparse_moe\.gate$", r"re:.*routed_expert_(down|up)_proj$", r"re:.*_res_proj$"]


@torch.no_grad()
def save_hf_checkpoint(model: K3ForCausalLM, out_dir: str | os.PathLike, *, dtype: torch.dtype | None = torch.bfloat16,
                       mxfp4_experts: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                       a_log_padded_to: int | None = None, prefix: str | None = None, progress: bool = True,
                       family: str | None = None, kimi_linear_format: str = "original") -> Path:
    """Write ``model`` in its family's layout into ``out_dir`` (new or empty; written to a temporary folder
    beside it and renamed into place). Returns ``out_dir``.

    family: "k3" (the release's layout, ``language_model.`` prefix) or "kimi_linear" (transformers'; needs a
    Kimi-Linear-shaped config, :func:`k3lab.hf.config.kimi_linear_mismatches`); None = the config's own
    (:func:`k3lab.hf.config.config_family`).
    kimi_linear_format: for family "kimi_linear", "original" (what ``save_pretrained`` writes by default) or
    "internal" (what it writes with ``save_original_format=False``: fused ``conv1d`` and ``gate_up_proj``,
    :func:`internal_part`); ``from_pretrained`` reads both.

    dtype: the stored dtype of everything but :data:`FP32_SUFFIXES` (float32); None keeps each tensor's own.
    mxfp4_experts: routed experts as MXFP4 (compressed-tensors, group 32; needs the expert widths to be
    multiples of 32), with the matching ``quantization_config`` in config.json.
    max_shard_bytes: shard size limit (one MXFP4 weight's two tensors stay in one shard).
    a_log_padded_to: store ``A_log`` zero-padded to this length (the release: 128 for 96 heads); None = [H].
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir}: exists and is not an empty folder; choose a new checkpoint folder")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: must be >= 1")
    cfg = model.config
    family, prefix = _layout(cfg, family, prefix, mxfp4_experts, a_log_padded_to, kimi_linear_format)
    hf = to_hf_config(cfg, family)  # raises for a config the family cannot describe, before anything is written
    if family == "kimi_linear" and dtype is not None:
        hf = dict(sorted(dict(hf, dtype=str(dtype).removeprefix("torch.")).items()))
    has_experts = any(EXPERT_PARAM.match(n) for n in model.state_dict())
    if mxfp4_experts:
        if not has_experts:
            raise ValueError(f"mxfp4_experts=True: the model has no routed experts (mlp_kind={cfg.mlp_kind!r})")
        width = cfg.routed_expert_hidden_size if cfg.mlp_kind == "latent_moe" else cfg.hidden_size
        for fname, v in (("routed_expert_hidden_size" if cfg.mlp_kind == "latent_moe" else "hidden_size", width),
                         ("moe_intermediate_size", cfg.moe_intermediate_size)):
            if v % mxfp4.GROUP_SIZE:
                raise ValueError(f"mxfp4_experts=True: {fname}={v} must be a multiple of {mxfp4.GROUP_SIZE} "
                                 "(MXFP4 groups run along each expert matrix's input dimension)")
    units = _plan(model, dtype, mxfp4_experts, a_log_padded_to, prefix, None, family, kimi_linear_format)
    shards: list[list[_Unit]] = [[]]
    size = 0
    for unit in units:
        if shards[-1] and size + unit.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += unit.nbytes

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        weight_map = {}
        bar = _bar(total=sum(len(u.names) for u in units), desc="write", disable=not progress)
        for k, shard in enumerate(shards, start=1):
            fname = SHARD_NAME.format(k, len(shards))
            tensors = {}
            for unit in shard:
                for name, t in zip(unit.names, unit.make()):
                    tensors[name] = t.cpu()
                    weight_map[name] = fname
                    bar.update(1)
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            del tensors
        bar.close()
        index = {"metadata": {"total_size": sum(u.nbytes for u in units)}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if mxfp4_experts:
            hf["quantization_config"] = mxfp4.quantization_config(_bf16_ignore(prefix))
        (tmp / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ----------------------------------------------------------------------------------------------
# reader
# ----------------------------------------------------------------------------------------------
@dataclass
class LoadedCheckpoint:
    """What :func:`load_hf_checkpoint` returns. Parameters outside ``loaded`` are on the meta device."""

    model: K3ForCausalLM
    config: ModelConfig
    path: Path
    layers: list[int]  # decoder layers materialised
    loaded: list[str] = field(default_factory=list)  # k3lab parameter names materialised
    tensors_read: int = 0  # stored tensors read (an MXFP4 weight counts two)
    bytes_read: int = 0
    dequantized: int = 0  # MXFP4 weights dequantized
    kimi_linear_format: str | None = None  # "original" / "internal" (transformers' two); None for K3


def read_hf_config(path: str | os.PathLike, **overrides) -> tuple[ModelConfig, dict | None]:
    """``(ModelConfig, quantization_config or None)`` from a checkpoint folder's config.json (errors name the file)."""
    file = Path(path) / CONFIG_FILE
    cfg = from_hf_config(file, **overrides)
    raw = json.loads(file.read_text())
    quant = raw.get("quantization_config", (raw.get("text_config") or {}).get("quantization_config"))
    return cfg, quant


def read_weight_map(path: str | os.PathLike) -> tuple[dict[str, str], Path]:
    """``({tensor name: shard file}, the file it came from)``: the index, or a lone model.safetensors."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            data = json.loads(index.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{index}: not valid JSON ({err})") from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise ValueError(f"{index}: field weight_map must map tensor names to shard file names")
        for name, shard in wm.items():
            if Path(shard).name != shard:
                raise ValueError(f"{index}: weight_map[{name!r}]={shard!r}: a shard must be a file name in the folder")
        return wm, index
    single = path / SINGLE_FILE
    if single.is_file():
        with _open_shard(single) as f:
            return {k: SINGLE_FILE for k in f.keys()}, single
    if not path.is_dir():
        raise ValueError(f"{path}: no such checkpoint folder")
    raise ValueError(f"{path}: no {INDEX_FILE} (nor {SINGLE_FILE}): not a Hugging Face safetensors checkpoint folder")


def _open_shard(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as err:  # safetensors raises its own error types for a bad header or a short file
        raise ValueError(f"{file}: cannot be read as safetensors ({type(err).__name__}: {err}); "
                         "the shard is truncated or not a safetensors file") from None


def _set_param(model: nn.Module, name: str, value: Tensor, requires_grad: bool) -> None:
    """Replace the (meta) parameter ``name`` by a Parameter holding ``value``."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[leaf] = nn.Parameter(value, requires_grad=requires_grad)


def _wanted(name: str, layers: set[int], embeddings: bool, head: bool, routed_experts: bool) -> bool:
    if name.startswith("model.layers."):
        i = int(name.split(".")[2])
        return i in layers and (routed_experts or EXPERT_PARAM.match(name) is None)
    if name.startswith(EMBED_PREFIX):
        return embeddings
    return head and name.startswith(HEAD_PREFIXES)


def _owned_by_selection(hf_name: str, prefix: str, layers: set[int] | None, embeddings: bool, head: bool,
                        routed_experts: bool) -> bool:
    """True where a stored tensor belongs to what was asked for (to find tensors the model does not have)."""
    if not hf_name.startswith(prefix):
        return False
    name = hf_name[len(prefix):]
    if name.startswith("model.layers."):
        parts = name.split(".")
        if not parts[2].isdigit():
            return True
        if layers is not None and int(parts[2]) not in layers:
            return False
        return routed_experts or ".experts." not in name
    if name.startswith(EMBED_PREFIX):
        return embeddings
    return head and (name.startswith(HEAD_PREFIXES) or name.startswith("model."))


def _parse_layers(layers, num_layers: int) -> list[int]:
    if layers is None:
        return list(range(num_layers))
    items = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else list(layers)
    for i in items:
        if not (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers):
            raise ValueError(f"layers={layers!r}: each entry must be a 0-based layer index in [0, {num_layers})")
    return sorted(set(items))


def _check_tied_head(head_name: str, embed_name: str, tensor, handle, family: str, file: Path,
                     config_file: Path) -> None:
    """A stored ``lm_head.weight`` under ``tie_word_embeddings``: accepted (read, and dropped for the tie) where it
    equals the stored embedding bit for bit, as in a Kimi Linear checkpoint (transformers' Kimi Linear never ties
    and stores the head, k3lab's writer a copy); a different head is a ValueError naming the field."""
    head = tensor(head_name)
    embed = handle(embed_name).get_tensor(embed_name)
    if tuple(head.shape) != tuple(embed.shape):
        raise ValueError(f"{file}: {head_name} has shape {list(head.shape)}, expected {list(embed.shape)} (the "
                         f"embedding's, tie_word_embeddings=true in {config_file.name})")
    if not torch.equal(head, embed.to(head.dtype)):
        also = (" transformers' KimiLinearForCausalLM never ties the two and would run the stored head;"
                if family == "kimi_linear" else "")
        raise ValueError(f"{file}: {head_name} differs from {embed_name}, but {config_file.name} says "
                         f"tie_word_embeddings=true (the head is the embedding):{also} k3lab ties them as the config "
                         f"says; set tie_word_embeddings to false in {config_file} to load the separate head")


@torch.no_grad()
def load_hf_checkpoint(path: str | os.PathLike, *, layers=None, embeddings: bool = True, head: bool = True,
                       routed_experts: bool = True, dtype: torch.dtype = torch.bfloat16,
                       device: str | torch.device = "cpu", progress: bool = True, **overrides) -> LoadedCheckpoint:
    """Build the model of ``path/config.json`` on the meta device and load a slice of its weights.

    layers: decoder layers to load (0-based: an int, a list, a range; None = all). embeddings: the token
    embedding; head: ``model.norm``, the output AttnRes, ``lm_head`` (and the MTP head, k3lab's names).
    routed_experts: False leaves the routed experts on meta (router, shared experts and latent projections are
    still loaded: K3's experts are 59 GB a layer in bf16). dtype: parameters' dtype except
    :data:`FP32_SUFFIXES` (float32). ``overrides`` go to ``from_hf_config`` (experiment switches, e.g. backend).
    """
    path = Path(path)
    cfg, quant = read_hf_config(path, **overrides)
    config_file = path / CONFIG_FILE
    family = hf_family(load_json(config_file)[0], str(config_file))
    weight_map, map_file = read_weight_map(path)
    prefix = PREFIX if any(k.startswith(PREFIX) for k in weight_map) else ""
    layer_list = _parse_layers(layers, cfg.num_hidden_layers)
    quant_scheme = None
    if quant is not None:
        quant_scheme = mxfp4.scheme(next(iter(quant["config_groups"].values())))

    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    device = torch.device(device)
    selected = {n: p for n, p in model.named_parameters() if _wanted(n, set(layer_list), embeddings, head, routed_experts)}
    if head and cfg.tie_word_embeddings and not embeddings:
        selected.update({n: p for n, p in model.named_parameters() if n.startswith(EMBED_PREFIX)})

    kl_format = detect_kimi_linear_format(weight_map, str(map_file)) if family == "kimi_linear" else None

    # what to read: (k3lab name, expert index or None, stored base name, fused Part or None)
    jobs = []
    for name, p in selected.items():
        m = EXPERT_PARAM.match(name)
        if kl_format == "internal":
            part = internal_part(name, tuple(p.shape))
            jobs.append((name, None, prefix + part.stored, part if part.fused_shape is not None else None))
        elif m is None:
            candidates = [n for n in stored_names(name, family, prefix) if n in weight_map]
            if len(candidates) > 1:
                raise ValueError(f"{map_file}: {name} is stored twice, as {candidates}")
            jobs.append((name, None, candidates[0] if candidates else stored_name(name, family, prefix), None))
        else:
            jobs += [(name, e, f"{prefix}{m['base']}.{e}.{m['w']}", None) for e in range(p.shape[0])]
    consumed = set()

    def locate(hf_name: str, shape: tuple) -> tuple[str, str | None]:
        """('plain' | 'mxfp4', the stored name)."""
        base = hf_name[:-len(".weight")] if hf_name.endswith(".weight") else hf_name
        plain, packed = hf_name in weight_map, f"{base}.weight_packed" in weight_map
        if plain and packed:
            raise ValueError(f"{map_file}: {hf_name} is stored both plain and MXFP4-packed ({base}.weight_packed)")
        if packed:
            if quant_scheme is None:
                raise ValueError(f"{config_file}: no quantization_config, but {base}.weight_packed is MXFP4-packed")
            if f"{base}.weight_scale" not in weight_map:
                raise ValueError(f"{map_file}: {base}.weight_packed has no {base}.weight_scale")
            return "mxfp4", base
        if not plain:
            raise ValueError(f"{map_file}: no tensor {hf_name} (k3lab needs it, shape {list(shape)}; "
                             f"config.json and the checkpoint disagree, or the checkpoint is incomplete)")
        return "plain", hf_name

    handles: dict[str, tuple[object, set[str]]] = {}  # shard -> (open safetensors file, its tensor names)
    out = LoadedCheckpoint(model, cfg, path, layer_list, kimi_linear_format=kl_format)
    with ExitStack() as stack:
        def handle(stored: str):
            shard = weight_map[stored]
            if shard not in handles:
                file = path / shard
                if not file.is_file():
                    raise ValueError(f"{file}: missing shard ({map_file.name} names it for {stored})")
                f = stack.enter_context(_open_shard(file))
                handles[shard] = (f, set(f.keys()))
            f, names = handles[shard]
            if stored not in names:
                raise ValueError(f"{path / shard}: has no tensor {stored} ({map_file.name} says it does)")
            return f

        def tensor(stored: str) -> Tensor:
            f = handle(stored)
            try:
                t = f.get_tensor(stored)
            except Exception as err:
                raise ValueError(f"{path / weight_map[stored]}: cannot read {stored} ({type(err).__name__}: {err}); "
                                 "the shard is truncated or damaged") from None
            consumed.add(stored)
            out.tensors_read += 1
            out.bytes_read += t.numel() * t.element_size()
            return t

        def fused_piece(name: str, stored: str, part: Part) -> Tensor:
            """k3lab's ``name``: its slice of fused tensor ``stored`` (only the slice is read; shape checked first)."""
            if stored not in weight_map:
                raise ValueError(f"{map_file}: no tensor {stored} (k3lab needs it for {name}, shape "
                                 f"{list(part.fused_shape)}; config.json and the checkpoint disagree, or the "
                                 "checkpoint is incomplete)")
            f = handle(stored)
            try:
                sl = f.get_slice(stored)
                shape = tuple(sl.get_shape())
            except Exception as err:
                raise ValueError(f"{path / weight_map[stored]}: cannot read {stored} ({type(err).__name__}: {err}); "
                                 "the shard is truncated or damaged") from None
            if shape != part.fused_shape:
                raise ValueError(f"{path / weight_map[stored]}: {stored} has shape {list(shape)}, expected "
                                 f"{list(part.fused_shape)} ({part.what}; transformers' internal format, from "
                                 f"{config_file.name})")
            index = tuple(slice(part.start, part.start + part.length) if d == part.axis else slice(None)
                          for d in range(len(shape)))
            try:
                t = sl[index]                                           # k3lab's [H·K, 1, W] or [E, I, D]
            except Exception as err:
                raise ValueError(f"{path / weight_map[stored]}: cannot read {stored} ({type(err).__name__}: {err}); "
                                 "the shard is truncated or damaged") from None
            if stored not in consumed:
                consumed.add(stored)
                out.tensors_read += 1
            out.bytes_read += t.numel() * t.element_size()
            return t

        values = {name: torch.empty(p.shape, dtype=stored_dtype(name, dtype), device=device)
                  for name, p in selected.items()}
        bar = _bar(jobs, desc="load", disable=not progress)
        for name, e, hf_name, part in bar:
            dest = values[name] if e is None else values[name][e]
            if part is not None:
                dest.copy_(fused_piece(name, hf_name, part))
                continue
            kind, stored = locate(hf_name if e is None else hf_name + ".weight", tuple(dest.shape))
            if kind == "mxfp4":
                packed, scale = tensor(f"{stored}.weight_packed"), tensor(f"{stored}.weight_scale")
                want_p, want_s = mxfp4.packed_shapes(tuple(dest.shape))
                if tuple(packed.shape) != want_p or tuple(scale.shape) != want_s:
                    raise ValueError(f"{path / weight_map[stored + '.weight_packed']}: {stored}.weight_packed "
                                     f"{list(packed.shape)} / weight_scale {list(scale.shape)}, expected {list(want_p)} / "
                                     f"{list(want_s)} (MXFP4 of {list(dest.shape)} from {config_file.name})")
                dest.copy_(mxfp4.dequantize(packed, scale, dtype=torch.bfloat16, name=stored, quant_scheme=quant_scheme))
                out.dequantized += 1
                continue
            t = tensor(stored)
            if name.endswith("self_attn.A_log") and family == "kimi_linear":
                if tuple(t.shape) != (1, 1, dest.shape[0], 1):
                    raise ValueError(f"{path / weight_map[stored]}: {stored} has shape {list(t.shape)}, expected "
                                     f"{[1, 1, dest.shape[0], 1]} (transformers' Kimi Linear layout, from {config_file.name})")
                t = t.view(dest.shape)
            if name.endswith("self_attn.A_log") and t.dim() == 1 and t.shape[0] > dest.shape[0]:
                H = dest.shape[0]
                if torch.count_nonzero(t[H:]):
                    warnings.warn(f"{path / weight_map[stored]}: {stored} is stored as [{t.shape[0]}] for {H} heads "
                                  f"and its padding is not zero; the first {H} entries are used", UserWarning)
                t = t[:H]
            if tuple(t.shape) != tuple(dest.shape):
                raise ValueError(f"{path / weight_map[stored]}: {stored} has shape {list(t.shape)}, expected "
                                 f"{list(dest.shape)} (from {config_file.name})")
            if not (t.is_floating_point() and dest.is_floating_point()) and t.dtype != dest.dtype:
                raise ValueError(f"{path / weight_map[stored]}: {stored} has dtype {t.dtype}, expected a float tensor")
            dest.copy_(t)
        bar.close()
        head_name = prefix + "lm_head.weight"
        if cfg.tie_word_embeddings and head and head_name in weight_map:
            _check_tied_head(head_name, prefix + EMBED_PREFIX + "weight", tensor, handle, family,
                             path / weight_map[head_name], config_file)

    extra = sorted(k for k in weight_map if k not in consumed and _owned_by_selection(
        k, prefix, None if layers is None else set(layer_list), embeddings, head, routed_experts))
    if extra:
        raise ValueError(f"{map_file}: {len(extra)} stored tensor(s) the model of {config_file.name} does not have, "
                         f"e.g. {extra[:5]} (config.json and the checkpoint disagree)")

    for name, value in values.items():
        _set_param(model, name, value, selected[name].requires_grad)
    out.loaded = sorted(values)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for module_name, module in model.named_modules():
        if not module_name.startswith("model.layers.") or int(module_name.split(".")[2]) not in layer_list:
            continue
        for buf_name, buf in list(module.named_buffers(recurse=False)):  # non-persistent statistics (MLA max_logit)
            if buf.is_meta:
                module._buffers[buf_name] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)
        if isinstance(module, LatentMoE):  # a fresh balancer on the loaded bias
            module.balancer = make_balancer(cfg.balancer, module.gate, num_bins=cfg.qb_num_bins,
                                            aux_loss_coef=cfg.aux_loss_coef)
    return out
