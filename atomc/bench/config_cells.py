"""The sweep cells of a CVS ATOM config: named shapes x concurrencies, keyed as the page keys them.

`sweep.sequence_combinations` are `{name, isl, osl}` shapes and `sweep.runs` `{combo, concurrency}`
cells (a run may set its own `num_prompts`); a cell's threshold key is
`ISL=..,OSL=..,TP=..,PP=..,CONC=..` (PP= always, nnodes never), so a lab's threshold file matches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from atomc.bench.config_file import SweepConfigError


def cell_key(isl: int, osl: int, tp: int, pp: int, concurrency: int) -> str:
    """The threshold key of a cell, as the page builds it (PP= always present; nnodes is not in it)."""
    return f"ISL={isl},OSL={osl},TP={tp},PP={pp},CONC={concurrency}"


@dataclass(frozen=True)
class SweepCell:
    combo: str
    isl: int
    osl: int
    tp: int
    pp: int
    concurrency: int
    num_prompts: int

    @property
    def key(self) -> str:
        return cell_key(self.isl, self.osl, self.tp, self.pp, self.concurrency)


def _positive_int(value, what: str) -> int:
    try:
        n = int(value)  # CVS writes isl/osl as strings
    except (TypeError, ValueError):
        raise SweepConfigError(f"{what} must be an integer, got {value!r}") from None
    if n <= 0:
        raise SweepConfigError(f"{what} must be positive, got {n}")
    return n


def build_cells(sweep: dict, params: dict) -> list[SweepCell]:
    combos = {}
    for combo in sweep.get("sequence_combinations") or []:
        name = combo.get("name")
        if not name or name in combos:
            raise SweepConfigError(f"sequence_combinations needs unique names, got {name!r}")
        combos[name] = combo
    cells: list[SweepCell] = []
    for i, run in enumerate(sweep.get("runs") or []):
        combo = combos.get(run.get("combo"))
        if combo is None:
            raise SweepConfigError(
                f"sweep.runs[{i}] names unknown combo {run.get('combo')!r} (known: {', '.join(combos) or 'none'})"
            )
        prompts = run.get("num_prompts", params.get("num_prompts"))
        if prompts is None:
            raise SweepConfigError(f"sweep.runs[{i}]: set params.num_prompts or the run's num_prompts")
        cells.append(
            SweepCell(
                combo=combo["name"],
                isl=_positive_int(combo.get("isl"), f"combo {combo['name']!r} isl"),
                osl=_positive_int(combo.get("osl"), f"combo {combo['name']!r} osl"),
                tp=params["tensor_parallelism"],
                pp=params["pipeline_parallel_size"],
                concurrency=_positive_int(run.get("concurrency"), f"sweep.runs[{i}].concurrency"),
                num_prompts=_positive_int(prompts, f"sweep.runs[{i}].num_prompts"),
            )
        )
    if not cells:
        raise SweepConfigError("sweep.runs is empty: nothing to run")
    keys = [c.key for c in cells]
    if len(set(keys)) != len(keys):
        raise SweepConfigError(f"two runs share a cell key; results would collide: {keys}")
    return cells


def cells_past_max_len(cells: list[SweepCell], params: dict) -> list[str]:
    """Notes for cells whose longest request (range ratio included) exceeds `max_model_length`:
    the server refuses those requests, which then count as failed. A note, not an error: shipped
    lab files have such cells (an 8k prompt with ratio 0.8 against a 10k context)."""
    limit = params["max_model_length"]
    if limit is None:
        return []
    r = params["random_range_ratio"]
    notes = []
    for c in cells:
        longest = math.ceil(c.isl * (1 + r)) + math.ceil(c.osl * (1 + r))
        if longest > limit:
            notes.append(
                f"cell {c.key}: its longest request ({longest} tokens with random_range_ratio {r:g}) exceeds "
                f"params.max_model_length {limit}; the server will refuse such requests (counted as failed)"
            )
    return notes
