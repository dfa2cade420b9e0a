"""The config tree is the one source of engine settings: CLI flags and LLM keywords map onto it."""

from __future__ import annotations

import inspect

import pytest
import typer

from atomc.cli.flags import _CONFIG_FLAGS, build_config
from atomc.cli.main import compile_, generate, serve
from atomc.config import EngineConfig


def test_update_sets_each_field_in_its_section():
    cfg = EngineConfig().update(max_num_seqs=3, dtype="float32", port=9, cudagraph_mixed_max_tokens=64, device="cpu")
    assert (cfg.scheduler.max_num_seqs, cfg.model.dtype, cfg.serve.port) == (3, "float32", 9)
    assert cfg.compile.cudagraph_mixed_max_tokens == 64 and cfg.device == "cpu"
    with pytest.raises(TypeError, match="no field 'max_num_seq'"):
        EngineConfig().update(max_num_seq=3)


def test_build_config_converts_cli_values():
    cfg = build_config(cudagraph_capture_sizes="8,1,4", disable_pass=["decode_gemv"], cache_dir=None, seed=5)
    assert cfg.compile.cudagraph_capture_sizes == [1, 4, 8]
    assert cfg.compile.disabled_passes == ["decode_gemv"]
    assert cfg.compile.cache_dir == EngineConfig().compile.cache_dir and cfg.model.seed == 5
    with pytest.raises(typer.BadParameter):
        build_config(cudagraph_capture_sizes="1,x")


@pytest.mark.parametrize("command", [serve, generate, compile_], ids=lambda c: c.__name__)
def test_cli_defaults_are_the_config_defaults(command):
    """A command's flag defaults, built into a config, give the default config: no second copy of a
    default can drift."""
    params = inspect.signature(command).parameters
    flags = {k: p.default for k, p in params.items() if k in _CONFIG_FLAGS}
    assert flags, "the command declares engine flags"
    built, default = build_config(**flags).to_dict(), EngineConfig().to_dict()
    assert built == default
