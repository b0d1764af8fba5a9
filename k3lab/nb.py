"""Small helpers every notebook uses: versions, parameter validation, the headline line."""

import platform


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
