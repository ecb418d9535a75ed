"""kvferry: disaggregated LLM inference on Kubernetes.

The offline API uses vLLM's names::

    from kvferry import LLM, SamplingParams

    llm = LLM(model="demo")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=16))
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from kvferry.engine.frontend.llm import LLM
    from kvferry.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy, so `import kvferry` (the operator, the CLI's --help) does not import torch.
    if name == "LLM":
        from kvferry.engine.frontend.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvferry.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvferry' has no attribute {name!r}")
