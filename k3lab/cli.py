"""Command-line flags generated from the config dataclasses: a new field is a new flag everywhere.

    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, TrainConfig, skip=("progress", "name"))
    args = parser.parse_args()
    with flag_errors(parser):
        cfg = dataclass_from_flags(TrainConfig, args)   # ValueError "TrainConfig.lr=..." -> "error: --lr: ..."

Each field ``name`` becomes ``--name-with-dashes``; the flag's type follows the annotation (``int``,
``float``, ``str``, ``bool`` as ``--x`` / ``--no-x``, ``X | None`` accepts ``none``, a tuple of numbers
takes several values, a ``dict`` takes JSON); the allowed values come from the class's ``CHOICES``
mapping (the same tuples its ``__post_init__`` checks), the help text from the comment after the field
in the class's source. Defaults are the dataclass's, unless the caller overrides some
(``defaults={"steps": 3}``). Used by ``python -m k3lab.parallel.run``, ``kernels/bench_train.py`` and
``kernels/profile_train_step.py``.

Errors read as argparse's own: :func:`flag_errors` turns a ValueError from a dataclass's validation
(``"TrainConfig.lr=inf: must be ..."``, ``"fit: stop_at=2: ..."``, ``"parallel dims: cp=3: ..."``) into
``error: --lr: must be ...`` and exit status 2 (a field with no flag of that name keeps its message, or
takes the flag ``aliases`` gives it); in a ``parallel dims`` reason the other fields it names
(``batch_size=8``) are written as their flags too (``--batch-size=8``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import re
import types
import typing

__all__ = ["add_dataclass_flags", "dataclass_from_flags", "field_value", "flag_errors", "flag_name", "flags_for"]


def flag_name(field: str) -> str:
    """``recompute_layers`` -> ``--recompute-layers``."""
    return "--" + field.replace("_", "-")


def _comments(cls) -> dict[str, str]:
    """``{field: the comment after it}`` from the class's source (its continuation lines joined)."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    found, last = {}, None
    for line in lines:
        m = re.match(r"\s+(\w+): [^=]+=.*?#\s*(.*)$", line)
        if m:
            last = m.group(1)
            found[last] = m.group(2).strip()
        elif last and re.match(r"\s+#\s*(.*)$", line):
            found[last] += " " + re.match(r"\s+#\s*(.*)$", line).group(1).strip()
        else:
            last = None
    return found


def _optional(kind):
    """``(inner type, True)`` for ``X | None``, else ``(kind, False)``."""
    args = typing.get_args(kind)
    if (typing.get_origin(kind) in (typing.Union, types.UnionType)) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return kind, False


def _parse(inner, optional: bool, name: str):
    def convert(text: str):
        if optional and text.lower() == "none":
            return None
        if inner is dict:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as err:
                raise argparse.ArgumentTypeError(f"not JSON ({err.msg})") from None
            if not isinstance(value, dict):
                raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"ns_dtype\": \"float32\"}'")
            return value
        try:
            return inner(text)
        except ValueError:
            article = "an" if inner.__name__[0] in "aeiou" else "a"
            raise argparse.ArgumentTypeError(f"{text!r} is not {article} {inner.__name__}") from None
    convert.__name__ = name  # argparse names the type in its message
    return convert


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, skip=(), defaults: dict | None = None,
                        title: str | None = None) -> list[str]:
    """Add one flag per field of dataclass ``cls`` (but those in ``skip``) to ``parser``; returns the field names."""
    hints = typing.get_type_hints(cls)
    helps, choices = _comments(cls), getattr(cls, "CHOICES", {})
    group = parser.add_argument_group(title or cls.__name__)
    names = []
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        default = (defaults or {}).get(f.name, f.default if f.default is not dataclasses.MISSING
                                       else f.default_factory())  # type: ignore[misc]
        inner, optional = _optional(hints[f.name])
        text = helps.get(f.name, "")
        kw: dict = dict(dest=f.name, default=default, help=f"{text} (default: {default!r})".replace("%", "%%"))
        if f.name in choices:
            kw["choices"] = choices[f.name]
        if inner is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(inner) is tuple:
            kw.update(nargs=len(typing.get_args(inner)), type=_parse(typing.get_args(inner)[0], False, "number"),
                      metavar=tuple(f"{f.name[:-1] if f.name.endswith('s') else f.name}{i + 1}"
                                    for i in range(len(typing.get_args(inner)))))
        else:
            kw["type"] = _parse(inner, optional, inner.__name__)
            if f.name not in choices:  # with choices argparse shows them: {a,b,c}
                kw["metavar"] = "JSON" if inner is dict else inner.__name__.upper()
        group.add_argument(flag_name(f.name), **kw)
        names.append(f.name)
    return names


def dataclass_from_flags(cls, args: argparse.Namespace, **overrides):
    """``cls(**{field: args.field})`` for the fields the parser has (plus ``overrides``); validation is the class's."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)


_TRUE, _FALSE = ("on", "true", "yes", "1"), ("off", "false", "no", "0")


def field_value(cls, name: str, text: str):
    """The value ``text`` gives field ``name`` of dataclass ``cls``, typed as its flag would parse it: for settings
    written as ``key=value`` outside the flags (``kernels/bench_train.py``'s ``MODEL-BxT@key=value``). A bool takes
    on|off (true|false, yes|no, 1|0), a tuple its numbers separated by ``/`` (``betas=0.9/0.95``), ``X | None``
    also ``none``, a dict JSON. Only the type is checked here (ValueError ``"Cls.name='text': reason"``); the
    allowed values and ranges are the class's own: construct it."""
    hints = typing.get_type_hints(cls)
    if name not in {f.name for f in dataclasses.fields(cls) if f.init}:
        raise ValueError(f"{cls.__name__} has no field {name!r}")
    inner, optional = _optional(hints[name])
    try:
        if inner is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise argparse.ArgumentTypeError(f"must be on|off ({'|'.join(_TRUE)} or {'|'.join(_FALSE)})")
            return text.lower() in _TRUE
        if typing.get_origin(inner) is tuple:
            parts, kinds = [t for t in re.split(r"[/\s]+", text.strip()) if t], typing.get_args(inner)
            if len(parts) != len(kinds):
                raise argparse.ArgumentTypeError(f"must be {len(kinds)} numbers separated by '/'")
            return tuple(_parse(kind, False, "number")(t) for kind, t in zip(kinds, parts))
        return _parse(inner, optional, inner.__name__)(text)
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"{cls.__name__}.{name}={text!r}: {err}") from None


# "TrainConfig.lr=inf: reason" and "parallel dims: cp=3: reason" (k3lab.parallel.dims)
def flags_for(obj, skip=()) -> list[str]:
    """The flags that give dataclass instance ``obj`` back through :func:`add_dataclass_flags` (every field but
    ``skip``): the inverse of :func:`dataclass_from_flags`, for a script that starts another run."""
    argv = []
    for f in dataclasses.fields(obj):
        if f.name in skip or not f.init:
            continue
        value = getattr(obj, f.name)
        if isinstance(value, bool):
            argv.append(flag_name(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, (tuple, list)):
            argv += [flag_name(f.name), *map(repr, value)]
        elif isinstance(value, dict):
            argv += [flag_name(f.name), json.dumps(value)]
        else:
            argv += [flag_name(f.name), "none" if value is None else str(value)]
    return argv


_FIELD_ERROR = re.compile(r"^(\w+\.|parallel dims: |fit: )(\w+)=(?:[^:]*?): (.*)$", re.S)
_NAMED_FIELD = re.compile(r"(?<![\w.\-])([a-z]\w*)=")


def _flag_of(parser: argparse.ArgumentParser, field: str, aliases: dict) -> str | None:
    flag = aliases.get(field, flag_name(field))
    return flag if flag in parser._option_string_actions else None


@contextlib.contextmanager
def flag_errors(parser: argparse.ArgumentParser, aliases: dict | None = None):
    """Inside: a ValueError exits as argparse does (``usage`` + ``error: --flag: reason``, status 2), the field a
    dataclass names turned into its flag (``aliases``: ``{field: flag}`` where the flag is named otherwise, e.g.
    ``{"resume_from": "--resume"}``); any other ValueError's one-line message follows ``error:``."""
    aliases = aliases or {}
    try:
        yield
    except ValueError as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        m = _FIELD_ERROR.match(message)
        flag = _flag_of(parser, m.group(2), aliases) if m else None
        if flag is None:
            parser.error(message)
        reason = m.group(3)
        if m.group(1) == "parallel dims: ":  # "must divide batch_size=8": the other fields as flags too
            reason = _NAMED_FIELD.sub(lambda f: f"{_flag_of(parser, f.group(1), aliases) or f.group(1)}=", reason)
        parser.error(f"{flag}: {reason}")
