"""One-line messages about a refused value: its kind and a short repr, the key as written, did-you-mean."""

from __future__ import annotations

import difflib
import functools
import reprlib
from typing import Any, Callable, Iterable

from rllib_recorder.errors import ConfigError

SHOW = reprlib.Repr()

SHOW.maxstring = SHOW.maxother = 60

SHOW.maxlist = SHOW.maxdict = SHOW.maxtuple = SHOW.maxset = 4

SHOW.maxlevel = 2


def one_line_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Every ConfigError leaves ``fn`` as one line (a name in the file may hold a line break)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            if len(str(e).splitlines()) <= 1:
                raise
            raise ConfigError(" ".join(str(e).split())) from None
    return wrapper


def describe_value(value: Any) -> str:
    kind = ("null" if value is None else "a boolean" if isinstance(value, bool) else
            "a number" if isinstance(value, (int, float)) else "a string" if isinstance(value, str) else
            "a list" if isinstance(value, (list, tuple)) else "a mapping" if isinstance(value, dict) else
            f"a {type(value).__name__}")
    return f"{kind} ({SHOW.repr(value)})" if value is not None else kind


def shown_key(key: Any) -> str:
    return key if isinstance(key, str) and key.isprintable() and len(key) <= 60 else SHOW.repr(key)


def did_you_mean(word: Any, candidates: Iterable[str]) -> str:
    if not isinstance(word, str):
        return ""
    candidates = list(candidates)
    folded = {c.lower(): c for c in candidates}
    close = ([folded[word.lower()]] if word.lower() in folded else
             difflib.get_close_matches(word, candidates, n=1, cutoff=0.6))
    return f" (did you mean {close[0]!r}?)" if close and close[0] != word else ""


def as_mapping(value: Any, where: str, example: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping ({example}); it is {describe_value(value)}")
    return value


def is_module_name(name: Any) -> bool:
    return isinstance(name, str) and all(part.isidentifier() for part in name.split("."))


def one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines)[:400] if lines else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def allowed_module(module: str, register: list[str], builtin: tuple[str, ...]) -> bool:
    return any(module == m or module.startswith(m + ".") for m in [*register, *builtin])
