"""Reading a JSON body's fields, for every API of the HTTP front: a field of the wrong type or
shape is a BadField (HTTP 400, `param` naming the field); a field the server does not implement
yet is refused unless it holds the value that turns it off."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class BadField(ValueError):
    """A field of the body has the wrong type or shape: HTTP 400, `param` names the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def get_field(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    """body[name] when it is one of `kinds` (None when absent or null); BadField otherwise."""
    value = body.get(name)
    if value is None:
        return None
    # bool is an int to Python, never to JSON Schema: true is not a number
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise BadField(f"{name} must be {what}, got {json.dumps(value)[:40]}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise BadField(f"{name} must be a finite number", name)
    return value


def off(*values: Any) -> Callable[[Any], bool]:
    """A field is off when it holds one of `values` (null always is)."""
    return lambda value: value is None or any(value == v and type(value) is type(v) for v in values)


def refuse_unsupported(body: dict, unsupported: dict[str, Callable[[Any], bool]]) -> None:
    """BadField naming the first field of `unsupported` (name -> its test for the value that
    turns it off) that the body holds and is not off."""
    for name, is_off in unsupported.items():
        if name in body and not is_off(body[name]):
            raise BadField(
                f"{name} is not supported by this server yet; leave it out (or send the value that turns it off)",
                name,
            )


def refuses_out_of_range(translate: F) -> F:
    """`translate` (a body -> request translation) with the values protobuf cannot hold (an
    integer past its field's 32- or 64-bit range, where no shape check caught it first) refused
    as a BadField (HTTP 400), not a server error."""

    @functools.wraps(translate)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return translate(*args, **kwargs)
        except BadField:
            raise
        except ValueError as exc:  # protobuf's "Value out of range: ..."
            raise BadField(f"a field holds a value out of its range ({str(exc)[:80]})", None) from None

    return checked  # type: ignore[return-value]
