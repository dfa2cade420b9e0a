"""Default sampling values from a checkpoint's generation_config.json.

Chat models ship tuned defaults (Llama-3-Instruct: temperature 0.6, top_p 0.9). Like vLLM, atomc uses
them for every field a request leaves unset; `--generation-config none` turns this off.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field. max_new_tokens is left out: a default length
# must never turn a request that fits the context into an error.
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def generation_defaults(model_dir: Path, mode: str) -> dict:
    """SamplingParams keyword defaults, or {} when mode is "none" or the checkpoint has none."""
    if mode not in ("auto", "none"):
        raise ValueError(f"--generation-config must be auto or none, got {mode!r}")
    path = Path(model_dir) / "generation_config.json"
    if mode == "none" or not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    defaults = {field: cfg[key] for key, field in _FIELDS.items() if cfg.get(key) is not None}
    if defaults:
        log.info("default sampling values from %s: %s", path.name, defaults)
    return defaults
