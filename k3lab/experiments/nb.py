"""Small helpers every notebook uses: versions, parameter validation, the headline line, the course model."""

import json
import platform
from pathlib import Path

COURSE_MODEL = Path(__file__).resolve().parents[1] / "assets" / "course_model"  # tools/train_course_model.py


def show_versions() -> dict:
    """Print (and return) the versions that matter for reproducing a notebook's numbers."""
    import numpy
    import torch

    import k3lab

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "k3lab": k3lab.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "absent"
    print("  ".join(f"{k}={v}" for k, v in info.items()))
    return info


def check_param(name, value, *, choices=None, type_=None, min_=None, max_=None):
    """Validate one papermill parameter; raise ValueError naming it and the allowed values."""
    if type_ is not None:
        types = type_ if isinstance(type_, tuple) else (type_,)
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            allowed = " or ".join(t.__name__ for t in types)
            raise ValueError(f"parameter {name}={value!r}: must be of type {allowed}")
    if choices is not None and value not in choices:
        raise ValueError(f"parameter {name}={value!r}: allowed values are {tuple(choices)}")
    if min_ is not None and value < min_:
        raise ValueError(f"parameter {name}={value!r}: must be >= {min_}")
    if max_ is not None and value > max_:
        raise ValueError(f"parameter {name}={value!r}: must be <= {max_}")
    return value


def check_params(namespace: dict, rules: dict) -> None:
    """Validate many papermill parameters at once: ``rules`` maps a name in ``namespace`` (a notebook's
    ``globals()``) to :func:`check_param`'s keywords, e.g. ``{"steps": dict(type_=int, min_=1)}``.

    A name missing from ``namespace`` is an error naming it (a rule for a parameter the cell lacks)."""
    for name, rule in rules.items():
        if name not in namespace:
            raise ValueError(f"parameter {name!r} has a rule but is not defined; defined: "
                             f"{sorted(k for k in namespace if not k.startswith('_'))[:20]}")
        check_param(name, namespace[name], **rule)


def headline(text: str) -> None:
    """Print the one-line result the course runner puts in its summary table."""
    print(f"HEADLINE: {text}")


# ----------------------------------------------------------------------------------------------
# progress bars, results over seeds, interactive explorers
# ----------------------------------------------------------------------------------------------
def progress(iterable=None, **kwargs):
    """A text ``tqdm`` bar on stdout (not a widget): a saved notebook shows its finished state
    (``100%|██████████| 7/7 [...]``), in JupyterLab, nbviewer and a terminal alike."""
    import sys

    from tqdm import tqdm

    kwargs.setdefault("mininterval", 0.1 if sys.stdout.isatty() else 1.0)  # fewer redraws saved in a notebook
    return tqdm(iterable, file=sys.stdout, **kwargs)


def mean_spread(values) -> tuple[float, float]:
    """``(mean, spread)`` of per-seed results, spread = half the range ``(max − min) / 2``.

    With 3 seeds the range is the honest spread (a standard deviation of 3 numbers says little);
    a gap between two means counts as real only if it exceeds the sum of the two spreads
    (:func:`compare_seeds`)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean_spread: no values")
    return sum(values) / len(values), (max(values) - min(values)) / 2


def compare_seeds(name_a: str, a, name_b: str, b, *, higher_is_better: bool = True, fmt: str = ".3f") -> dict:
    """Compare per-seed results of two variants; the verdict is computed, never hand-written.

    Returns ``{"mean_a", "spread_a", "mean_b", "spread_b", "gap", "confirmed", "text"}``: ``gap`` is
    ``mean_a − mean_b`` (sign flipped when lower is better, so a positive gap means *a is better*),
    ``confirmed`` is ``gap > spread_a + spread_b`` (the intervals mean ± spread do not overlap),
    ``status`` the claims-ledger word for "a is better than b" (``"confirmed"``, ``"contradicted"``
    when b is better by more than the spread, else ``"not reproduced at this scale"``), and ``text`` a
    sentence saying which is better and whether the gap exceeds the spread."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"compare_seeds: need >= 2 seeds per variant, got {len(a)} and {len(b)}")
    (ma, sa), (mb, sb) = mean_spread(a), mean_spread(b)
    gap = (ma - mb) if higher_is_better else (mb - ma)
    spread = sa + sb
    confirmed = gap > spread
    better, worse = (name_a, name_b) if gap >= 0 else (name_b, name_a)
    verdict = ("the gap exceeds the seed spread" if abs(gap) > spread
               else "the gap is within the seed spread: no difference at this scale")
    text = (f"{name_a} {ma:{fmt}} ± {sa:{fmt}} vs {name_b} {mb:{fmt}} ± {sb:{fmt}} "
            f"(mean ± half-range over {len(a)} and {len(b)} seeds): {better} is better by {abs(gap):{fmt}}, "
            f"{verdict} ({spread:{fmt}})")
    status = "confirmed" if confirmed else ("contradicted" if -gap > spread else "not reproduced at this scale")
    return dict(mean_a=ma, spread_a=sa, mean_b=mb, spread_b=sb, gap=gap, confirmed=confirmed, status=status,
                text=text)


INTERACTIVE_CHOICES = ("auto", True, False)


def resolve_interactive(interactive) -> bool:
    """Whether an explorer draws sliders (``True``) or one static plot (``False``).

    ``"auto"``: sliders when the kernel was started by a Jupyter server (JupyterLab and Notebook set
    ``JPY_SESSION_NAME`` in the kernel's environment) and ipywidgets imports; papermill, nbval and
    ``python -m k3lab course`` start kernels without it and get the static plot, which is what a
    committed notebook shows. ``True`` / ``False`` force either."""
    import os

    check_param("interactive", interactive, choices=INTERACTIVE_CHOICES)
    if interactive == "auto":
        if not os.environ.get("JPY_SESSION_NAME"):
            return False
        interactive = True
    if interactive:
        try:
            import ipywidgets  # noqa: F401
        except ImportError:
            return False
    return bool(interactive)


def explore(plot, interactive, **controls) -> dict:
    """An explorer: ``plot(**values)`` under sliders in JupyterLab, or once at the defaults elsewhere.

    ``controls``: ``name=(options, default)``, ``options`` a list of the values a slider steps
    through (``default`` one of them). With :func:`resolve_interactive` true this is
    ``ipywidgets.interact(plot, name=SelectionSlider(options, value=default), ...)``: moving a slider
    re-runs ``plot``. Otherwise (papermill, nbval, ``interactive=False``) ``plot`` runs once with the
    defaults and a line says how to get the sliders. Returns the default values."""
    defaults = {}
    for name, spec in controls.items():
        if not (isinstance(spec, tuple) and len(spec) == 2 and list(spec[0]) and spec[1] in list(spec[0])):
            raise ValueError(f"explore: control {name}={spec!r} must be (options, default) with default in options")
        defaults[name] = spec[1]
    if resolve_interactive(interactive):
        import ipywidgets

        sliders = {name: ipywidgets.SelectionSlider(options=list(opts), value=default, description=name,
                                                    continuous_update=False,
                                                    style={"description_width": "initial"},
                                                    layout=ipywidgets.Layout(width="480px"))
                   for name, (opts, default) in controls.items()}
        ipywidgets.interact(plot, **sliders)
    else:
        print("static plot at " + ", ".join(f"{k}={v!r}" for k, v in defaults.items())
              + " (in JupyterLab this cell shows sliders; interactive=True forces them)")
        plot(**defaults)
    return defaults


def course_model_card() -> dict | None:
    """The course model's ``card.json`` (how it was trained: command, steps, tokens, loss curve, a sample), or None
    when the files are missing."""
    card = COURSE_MODEL / "card.json"
    return json.loads(card.read_text()) if card.is_file() else None


def load_course_model(device="cpu"):
    """The course model — K3's ``tiny`` preset with one MTP head, trained on the KJV corpus by
    ``tools/train_course_model.py`` (its card: :func:`course_model_card`) — in float32 on ``device``, in eval mode;
    None when the files are missing (the notebooks then train a model in place, as before the file existed)."""
    if not (COURSE_MODEL / "config.json").is_file():
        return None
    import torch

    from k3lab.hf.checkpoint import load_hf_checkpoint

    loaded = load_hf_checkpoint(COURSE_MODEL, dtype=torch.float32, device=device, progress=False)
    return loaded.model.eval()
