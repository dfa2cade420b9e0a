"""The offline `atomc_arith` task: deterministic problems whose worked answers are right."""

from __future__ import annotations

import re

from atomc.bench import arith

STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def test_same_seed_same_problems_other_seed_others():
    assert arith.generate(7, 30) == arith.generate(7, 30)
    assert arith.generate(7, 30) != arith.generate(8, 30)


def test_every_step_and_final_answer_is_correct():
    ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__floordiv__}
    for row in arith.generate(0, 300):
        steps = STEP.findall(row["answer"])
        assert len(steps) >= 2, row
        for a, op, b, c in steps:
            a, b, c = int(a), int(b), int(c)
            assert ops[op](a, b) == c, row
            if op == "/":
                assert a % b == 0, row  # the division is exact
        final = int(arith.final_answer(row["answer"]))
        assert final == int(steps[-1][3]) and final >= 0
        assert row["question"].endswith("?")


def test_shipped_files_are_what_the_generator_writes(tmp_path):
    written = arith.write_task_data(tmp_path)
    for path in written:
        shipped = arith.TASK_DIR / path.name
        assert shipped.read_bytes() == path.read_bytes(), f"{shipped} is stale: run python -m atomc.bench.arith"
    assert (arith.TASK_DIR / "atomc_arith.yaml").is_file()
