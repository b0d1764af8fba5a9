"""Pinned autotuning, for test runs: every Triton autotuner runs one configuration and times none.

k3lab's own kernels are not autotuned — they launch with fixed parameters chosen from timings on an H200
(``k3lab.kernels.kda.LAUNCH``; the AttnRes, MoE-row and AdamW kernels fixed ones or ones computed from the shapes).
fla's kernels are (``@triton.autotune``): a first call with a new key (dtype, head count, head dims, ...)
compiles and times every candidate configuration, which took minutes per case on an H200 with an empty
Triton cache (one fp32 test of fla's KDA 269 s; issue 27). A test checks results, not speed, and a
configuration changes only speed (and whether the kernel fits the GPU's resources), so while pinned each
autotuner takes the first configuration that compiles and launches: one compile per kernel and key.

The order it tries: the configurations ``preferred`` names for the kernel (e.g. the fastest of a recorded
autotuning run, ``conftest.recorded_best_configs``), then the kernel's own candidates, fewest pipeline stages
(least shared memory) first. One that fails to compile or does not fit the GPU (what Triton's autotuner itself
scores as infinitely slow) is passed over. The pinned choice is not a timing, so pinned autotuners neither read
nor write Triton's on-disk autotuning results (``*.autotune.json``): a later unpinned run tunes as before.

Production code never pins: ``conftest.py`` does, for pytest runs that select the ``gpu`` tests
(``K3LAB_PIN_AUTOTUNE=0`` turns it off there). :func:`pin_autotuning` returns the function that undoes it.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

_MISSING = object()
_installed: list[Callable[[], None]] = []  # the undo of the active pin (at most one)


def _matches(config, want: Mapping) -> bool:
    """``config`` has ``want``'s kwargs and, where given, its num_warps and num_stages."""
    return (dict(config.kwargs) == dict(want.get("kwargs", {}))
            and config.num_warps == want.get("num_warps", config.num_warps)
            and config.num_stages == want.get("num_stages", config.num_stages))


def pinned_order(name: str, configs: Sequence, preferred: Mapping[str, Sequence[Mapping]]) -> list:
    """``configs`` in the order a pinned autotuner tries them: those ``preferred[name]`` lists (in its order),
    then the others, fewest ``num_stages`` first (a stable sort: the kernel's own order among equals)."""
    first = []
    for want in preferred.get(name, ()):
        first += [c for c in configs if _matches(c, want) and not any(c is f for f in first)]
    rest = [c for c in configs if not any(c is f for f in first)]
    return first + sorted(rest, key=lambda c: c.num_stages or 0)


def _run_once(kernel_call, quantiles=None, **_):
    """In place of the autotuner's benchmark: launch once (compiling the kernel), time nothing."""
    kernel_call()
    return [0.0] * (len(quantiles) if quantiles else 1)


def pin_autotuning(preferred: Mapping[str, Sequence[Mapping]] | None = None) -> Callable[[], None]:
    """Pin every ``triton.runtime.autotuner.Autotuner`` (fla's included, made before or after this call) to
    one configuration per key, as the module docstring says; ``preferred``: kernel name -> configurations
    (``{"kwargs": {...}, "num_warps": w, "num_stages": s}``) to try first. Returns the undo function."""
    if _installed:
        raise RuntimeError("pin_autotuning: already pinned; call the function it returned first")
    from triton.runtime.autotuner import Autotuner

    table = dict(preferred or {})
    originals = {name: Autotuner.__dict__[name] for name in ("prune_configs", "_bench", "check_disk_cache")
                 if name in Autotuner.__dict__}  # check_disk_cache: in the Triton versions with cache_results
    prune, bench = originals["prune_configs"], originals["_bench"]

    def prune_configs(self, kwargs):
        self._k3lab_pinned = None  # a new key: nothing has run for it yet
        name = getattr(getattr(self, "base_fn", None), "__name__", "")
        return pinned_order(name, prune(self, kwargs), table)

    def _bench(self, *args, config, **meta):
        if getattr(self, "_k3lab_pinned", None) is not None:
            return [math.inf] * 3  # a configuration already ran for this key: the rest are neither compiled nor run
        kept = self.__dict__.get("do_bench", _MISSING)  # do_bench is a cached property: the instance's own wins
        self.__dict__["do_bench"] = _run_once
        try:
            timings = bench(self, *args, config=config, **meta)  # Triton's own: inf when it does not compile or fit
        finally:
            if kept is _MISSING:
                self.__dict__.pop("do_bench", None)
            else:
                self.__dict__["do_bench"] = kept
        if math.isfinite(timings[0]):
            self._k3lab_pinned = config
        return timings

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        bench_fn()  # pinned: neither take a recorded result nor record the pinned choice as one
        return False

    Autotuner.prune_configs = prune_configs
    Autotuner._bench = _bench
    if "check_disk_cache" in originals:
        Autotuner.check_disk_cache = check_disk_cache

    def undo() -> None:
        for name, fn in originals.items():
            setattr(Autotuner, name, fn)
        _installed.clear()

    _installed.append(undo)
    return undo


def autotuning_pinned() -> bool:
    """Whether :func:`pin_autotuning` is in effect."""
    return bool(_installed)
