"""detserve: LLM serving where any request can ask for bit-exact reproducible output."""

from detserve.outputs import RequestOutput, TokenLogprob
from detserve.params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams", "TokenLogprob"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # torch-heavy parts load on first use, so `import detserve` stays cheap for the CLI
    if name == "LLM":
        from detserve.llm import LLM
        return LLM
    if name == "LLMEngine":
        from detserve.engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
