"""The request fields that constrain the output, read into one `StructuredOutputsParams`.

OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `name`, `schema`, `strict`),
vLLM's `structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`,
`disable_any_whitespace`) and vLLM's older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. A request may use one of them; two are a 400, as is a value of the wrong shape.
Each result carries the name of the field it came from, so a constraint the grammar engine cannot
compile is a 400 that names that field (the compile itself runs in the route, see api.py). Errors
are `FieldError`s, which sampling_request.py turns into 400s (this module sits below it).
"""

from __future__ import annotations

from typing import Any

from atomc.sampling_params import StructuredOutputsParams


class FieldError(ValueError):
    """A constraint field of the wrong shape; `param` is the field (sampling_request.py makes it a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def bad_request(message: str, param: str) -> FieldError:
    return FieldError(message, param)

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint a chat or completions request asks for and the field it came from, or (None, None)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        so = _from_response_format(rf)
        if so is not None:
            found.append((so, "response_format"))
    so_field = getattr(req, "structured_outputs", None)
    if so_field is not None:
        found.append((_from_structured_outputs(so_field), "structured_outputs"))
    for name, kind in GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append((_make(name, **{kind: value}), name))
    if len(found) > 1:
        names = ", ".join(name for _, name in found)
        raise bad_request(f"only one of response_format, structured_outputs and guided_* may be set; got {names}",
                          found[1][1])  # fmt: skip
    return found[0] if found else (None, None)


def _make(param: str, **kw) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except (ValueError, TypeError) as e:
        raise bad_request(f"{param}: {e}", param) from None


def _from_response_format(rf: Any) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _make("response_format", json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object with a schema", "response_format")
        schema = spec.get("schema")
        if schema is None:  # a name without a schema: any JSON object, as OpenAI accepts it
            return _make("response_format", json_object=True)
        if not isinstance(schema, dict | bool):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object", "response_format")
        # `strict`: xgrammar holds every output to the schema already (no extra properties unless
        # the schema allows them), which is what strict asks for; so it changes nothing here
        return _make("response_format", json=schema)
    raise bad_request(
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema", "response_format"
    )


def _from_structured_outputs(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    if value.get("structural_tag") is not None:
        raise bad_request("structured_outputs.structural_tag is not supported", "structured_outputs")
    kw = {k: value[k] for k in _SO_KEYS if value.get(k) is not None}
    if "json_object" in kw and not isinstance(kw["json_object"], bool):
        raise bad_request("structured_outputs.json_object must be a boolean", "structured_outputs")
    if "choice" in kw and not isinstance(kw["choice"], list):
        raise bad_request("structured_outputs.choice must be a list of strings", "structured_outputs")
    for k in ("regex", "grammar"):
        if k in kw and not isinstance(kw[k], str):
            raise bad_request(f"structured_outputs.{k} must be a string", "structured_outputs")
    if "json" in kw and not isinstance(kw["json"], str | dict):
        raise bad_request("structured_outputs.json must be a JSON schema (an object or its text)", "structured_outputs")
    kw["disable_any_whitespace"] = bool(value.get("disable_any_whitespace", False))
    return _make("structured_outputs", **kw)
