"""atomc: a compiler-centric LLM inference engine."""

from atomc.outputs import CompletionOutput, RequestOutput
from atomc.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for
    if name == "LLM":
        from atomc.llm import LLM

        return LLM
    raise AttributeError(name)
