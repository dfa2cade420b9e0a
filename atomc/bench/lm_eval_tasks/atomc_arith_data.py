"""The `atomc_arith` lm-eval task's data: the JSONL files beside this file, read as a dataset.

lm-eval resolves a task's `data_files` against the working directory, not the task's folder, so
the task points at this loader (`custom_dataset`) instead; it finds the files wherever atomc is
installed. Standalone on purpose: lm-eval imports it by path, outside the atomc package.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
FILES = {"test": "atomc_arith_test.jsonl", "train": "atomc_arith_train.jsonl"}


def load(**_metadata):
    # lm-eval passes the task's metadata (and the model's arguments) as keywords: none apply here
    import datasets

    return datasets.DatasetDict(
        {split: datasets.load_dataset("json", data_files=str(HERE / f), split="train") for split, f in FILES.items()}
    )
