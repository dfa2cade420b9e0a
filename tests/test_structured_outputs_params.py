"""StructuredOutputsParams, the contract between the API, the grammar engine and the sampler."""

import pytest

from atomc.sampling_params import SamplingParams, StructuredOutputsParams


def test_one_kind_names_itself():
    assert StructuredOutputsParams(json={"type": "object"}).kind == "json"
    assert StructuredOutputsParams(regex="[0-9]+").kind == "regex"
    assert StructuredOutputsParams(choice=["yes", "no"]).kind == "choice"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    p = SamplingParams(structured_outputs=StructuredOutputsParams(grammar='root ::= "a"'))
    assert p.structured_outputs.kind == "grammar"


@pytest.mark.parametrize(
    "kwargs", [{}, {"json": "{}", "regex": "a"}, {"choice": []}, {"choice": ["a", ""]}, {"json_object": False}]
)
def test_none_or_several_kinds_are_refused(kwargs):
    with pytest.raises(ValueError, match="structured outputs"):
        StructuredOutputsParams(**kwargs)
