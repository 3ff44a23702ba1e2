"""tinyserve: a small but real LLM inference engine, built alongside chapter 5."""

#: The public names and the module each lives in. They are imported on first use
#: (PEP 562), so that tools that need no model, such as ``tinyserve diagnose``,
#: start without importing torch.
EXPORTS = {"LLM": ("tinyserve.engine", "LLM"), "LLMEngine": ("tinyserve.engine", "LLMEngine"),
           "RequestOutput": ("tinyserve.engine", "RequestOutput"),
           "device": ("tinyserve.model", "default_device"),
           "SamplingParams": ("tinyserve.request", "SamplingParams")}

__all__ = list(EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in EXPORTS:
        raise AttributeError(f"module 'tinyserve' has no attribute {name!r}")
    import importlib
    module, attribute = EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
