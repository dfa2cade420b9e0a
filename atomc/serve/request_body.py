"""A decoded JSON body checked and validated into a request model, every failure one readable 400.

Before a model sees a body, `check_json_body` refuses what would break later stages: nesting deeper
than `MAX_JSON_DEPTH` and strings holding lone UTF-16 surrogates (not UTF-8, so the tokenizer cannot
take them). `parse_request` then runs pydantic and turns its error list into one 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from atomc.serve.api_errors import bad_request

MAX_JSON_DEPTH = 32  # chat content parts are 5 levels; a tool schema adds two per nested object


def check_json_body(data: Any) -> None:
    """400 for nesting deeper than MAX_JSON_DEPTH or a string that is not valid Unicode (a lone
    surrogate from a `\\ud800` escape); one iterative walk, so no depth can overflow the stack."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            _check_text(value, where)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            field = where.split(".")[0].split("[")[0] or None
            raise bad_request(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", field)
        if isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, where)
                if isinstance(v, str | dict | list):
                    stack.append((v, depth + 1, f"{where}.{k}" if where else k))
        else:
            for i, v in enumerate(value):
                if isinstance(v, str | dict | list):
                    stack.append((v, depth + 1, f"{where}[{i}]"))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        field = where.split(".")[0].split("[")[0] or None
        message = f"{where or 'a key'}: string holds a lone UTF-16 surrogate, which is not valid Unicode"
        raise bad_request(message, field) from None


def parse_request(model: type[BaseModel], data: Any) -> Any:
    """Validate a decoded JSON body; pydantic errors become one readable 400."""
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    check_json_body(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        # a union reports one error per member; the first is the most readable
        err = e.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(str(x) for x in err["loc"])
        raise bad_request(f"{where}: {err['msg']}" if where else err["msg"], param) from None
