"""The data of atomc's offline lm-eval tasks: the JSONL files beside this file, read as datasets.

lm-eval resolves a task's `data_files` against the working directory, not the task's folder, so
each task points at a loader here (`custom_dataset`) instead; it finds the files wherever atomc is
installed. Standalone on purpose: lm-eval imports it by path, outside the atomc package.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent


def _splits(files: dict[str, str]):
    import datasets

    return datasets.DatasetDict(
        {split: datasets.load_dataset("json", data_files=str(HERE / f), split="train") for split, f in files.items()}
    )


# lm-eval passes the task's metadata (and the model's arguments) as keywords: none apply here
def load_arith(**_metadata):
    return _splits({"test": "atomc_arith_test.jsonl", "train": "atomc_arith_train.jsonl"})


def load_agreement(**_metadata):
    return _splits({"test": "atomc_agreement_test.jsonl"})
