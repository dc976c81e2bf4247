"""dspark: an LLM serving engine with DSpark speculative decoding and adaptive verification."""

from dspark.outputs import CompletionOutput, RequestOutput
from dspark.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: importing dspark must stay cheap (and never touch a GPU).
    if name == "LLM":
        from dspark.llm import LLM

        return LLM
    raise AttributeError(name)
