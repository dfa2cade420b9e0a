"""Which module runs each optional block of a CVS config, and in which phase of the run.

Keyed by the block's name in the config (a sub-check of a block is `block.check`, as the page
writes them: `functional.api_smoke`, `platform.dmesg_scan`). A module is imported only when its
block is configured; one that is missing (not built yet, or an optional dependency absent) makes
that block an ERROR "not available", never a crash of the run. Adding a block = adding a row.

Phases: `before` runs ahead of the sweep (FUNC-1/2 must pass on a fresh server before load),
`during` brackets the sweep (`start(spec, ctx)` returns a handle whose `stop()` gives the
BlockResult: pollers and the dmesg window), `after` runs once the sweep is done (quality blocks
send their own traffic and must not disturb the measured cells).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from atomc.bench.blocks import BlockResult, SuiteContext


@dataclass(frozen=True)
class BlockEntry:
    name: str  # the block's name in the config and in the report
    module: str
    function: str = "run"  # `run(spec, ctx) -> BlockResult`, or for phase "during" `start(spec, ctx) -> handle`
    phase: str = "after"
    # True: the block gates its own figures against its threshold-file key (per task or cell, read
    # from ctx.thresholds) and its verdict says so; False: the suite gates `BlockResult.metrics`
    self_gated: bool = False
    # whether a block present in the config runs without `enabled: true` (CVS: mtp_quality and
    # quant_parity are off unless enabled; accuracy and long-context run when configured)
    enabled_by_default: bool = True


REGISTRY: tuple[BlockEntry, ...] = (
    BlockEntry("functional.health_check", "atomc.bench.blocks.functional", "run_health_check", "before"),
    BlockEntry("functional.api_smoke", "atomc.bench.blocks.functional", "run_api_smoke", "before"),
    BlockEntry("platform.dmesg_scan", "atomc.bench.blocks.platform", "start_dmesg_scan", "during"),
    BlockEntry("platform.gpu_metrics_poll", "atomc.bench.blocks.platform", "start_gpu_metrics_poll", "during"),
    BlockEntry("mtp_quality", "atomc.bench.blocks.mtp_quality", enabled_by_default=False),
    BlockEntry("accuracy", "atomc.bench.blocks.accuracy", self_gated=True),
    BlockEntry("long_context_accuracy", "atomc.bench.blocks.long_context", self_gated=True),
    BlockEntry("quant_parity", "atomc.bench.blocks.quant_parity", enabled_by_default=False),
)
BY_NAME = {e.name: e for e in REGISTRY}
# blocks whose config object holds on/off sub-checks (`"functional": {"api_smoke": true}`)
GROUPED = ("functional", "platform")


def configured_blocks(blocks: dict[str, dict]) -> list[tuple[BlockEntry, dict]]:
    """The (entry, spec) pairs a config asks for, in registry order. A sub-check is on when its
    value is `true` or an object (its options); a whole block runs per its `enabled` (default:
    the entry's `enabled_by_default`)."""
    chosen = []
    for group in GROUPED:
        spec = blocks.get(group) or {}
        known = {e.name.split(".", 1)[1] for e in REGISTRY if e.name.startswith(group + ".")}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"unknown {group} checks {unknown}; known: {', '.join(sorted(known))}")
    for entry in REGISTRY:
        group, _, check = entry.name.partition(".")
        if check:
            value = (blocks.get(group) or {}).get(check)
            if value is True or (isinstance(value, dict) and value.get("enabled", True)):
                chosen.append((entry, value if isinstance(value, dict) else {}))
            elif value not in (None, False):
                raise ValueError(f"{entry.name} must be true, false or an object, got {value!r}")
        elif entry.name in blocks and blocks[entry.name].get("enabled", entry.enabled_by_default):
            chosen.append((entry, blocks[entry.name]))
    return chosen


def resolve(entry: BlockEntry):
    """The callable of a block, or a BlockResult ERROR saying why it is not available."""
    try:
        module = importlib.import_module(entry.module)
    except ModuleNotFoundError as exc:
        return BlockResult(entry.name, "ERROR", f"not available: {exc}")
    fn = getattr(module, entry.function, None)
    if fn is None:
        return BlockResult(entry.name, "ERROR", f"not available: {entry.module} has no {entry.function}()")
    return fn


def run_block(entry: BlockEntry, spec: dict, ctx: SuiteContext) -> BlockResult:
    """Run a `before`/`after` block; an exception inside it becomes its ERROR, not the run's end."""
    fn = resolve(entry)
    if isinstance(fn, BlockResult):
        return fn
    try:
        result = fn(spec, ctx)
    except Exception as exc:  # a block is an independent check: its failure is reported, the run goes on
        return BlockResult(entry.name, "ERROR", f"{type(exc).__name__}: {exc}")
    result.block = entry.name
    return result
