"""A request body on the wire -> a validated request model: JSON decoding, text that UTF-8 can carry,
then pydantic; every failure is an :class:`~eagleray.serve.protocol.APIError` 400 naming the field.

    req = parse_body(await request.body(), ChatCompletionRequest)
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from eagleray.serve.protocol import ERROR_CODES, APIError, FieldError

MAX_JSON_DEPTH = 32  # OpenAI bodies nest 5 levels deep


def _param_of(loc: tuple) -> str | None:
    # Drop the union-branch names pydantic inserts (e.g. "str", "list[TextPart]") so param stays a field path.
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "function-after")))]
    return ".".join(parts) or None


def validation_error(err: ValidationError) -> APIError:
    """The first problem of a pydantic error as a 400 naming the field (all problems in the message)."""
    problems = []
    for e in err.errors():
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):  # raised by a model validator: it names its own field
            param = ".".join(p for p in (_param_of(e["loc"]), cause.param) if p)
            problems.append((param, cause.message, cause.code))
            continue
        param = _param_of(e["loc"])
        hint = (
            "unknown field; remove it or fix its spelling"
            if e["type"] == "extra_forbidden"
            else e["msg"].removeprefix("Value error, ")
        )
        code = ERROR_CODES.get(e["type"], "invalid_type" if e["type"].endswith(("_type", "_parsing")) else "invalid_value")
        problems.append((param, hint, code))
    param, _, code = problems[0]
    return APIError(400, "; ".join(f"{p or 'body'}: {m}" for p, m, _ in problems[:5]), param=param, code=code)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def _surrogate(s: str) -> int | None:
    """Index of the first character UTF-8 cannot carry (a lone UTF-16 surrogate), else None."""
    try:
        s.encode("utf-8")
        return None
    except UnicodeEncodeError as err:
        return err.start


def check_text(data: Any) -> None:
    """Every string (and key) in ``data`` must be Unicode text UTF-8 can carry; a 400 names the first that is not."""
    stack: list[tuple[str, Any, int]] = [("", data, 0)]
    while stack:
        path, value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"{path}: nested more than {MAX_JSON_DEPTH} levels deep", param=path, code="invalid_value")
        if isinstance(value, str):
            at = _surrogate(value)
            if at is not None:
                raise APIError(
                    400,
                    f"{path or 'body'}: character {at} is a lone UTF-16 surrogate (U+{ord(value[at]):04X}), "
                    f"which is not text; send valid Unicode (a \\ud800-\\udbff escape must be followed by a "
                    f"\\udc00-\\udfff one)",
                    param=path or None,
                    code="invalid_encoding",
                )
        elif isinstance(value, dict):
            for k, v in value.items():
                at = _surrogate(k)
                if at is not None:
                    raise APIError(
                        400,
                        f"{path or 'body'}: a key holds a lone UTF-16 surrogate (U+{ord(k[at]):04X}) at "
                        f"character {at}; send valid Unicode",
                        param=path or None,
                        code="invalid_encoding",
                    )
                stack.append((f"{path}.{k}" if path else k, v, depth + 1))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), v, depth + 1) for i, v in enumerate(value))


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON bytes -> validated request; every failure is an :class:`APIError` (400)."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"request body is not valid JSON: {err}", code="invalid_json") from None
    except ValueError as err:  # NaN / Infinity (parse_constant)
        raise APIError(400, f"request body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply to be a request", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    check_text(data)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise validation_error(err) from None
