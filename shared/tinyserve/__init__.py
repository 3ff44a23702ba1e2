"""tinyserve: a small but real LLM inference engine, built alongside chapter 5."""

from tinyserve.engine import LLM, LLMEngine, RequestOutput
from tinyserve.model import default_device as device
from tinyserve.request import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams", "device"]
__version__ = "0.1.0"
