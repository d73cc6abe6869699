"""Placeholder written by kvstrata's scripts/vllm_env.sh: torchvision is not installed.

vLLM's Qwen3.5 module imports a transformers image processor at import time, which imports
``torchvision.transforms``; nothing a text-only engine runs calls it. ``__version__`` 0.0.0
makes transformers' version gates pick their non-torchvision paths.
"""

__version__ = "0.0.0"


class _Placeholder:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> "_Placeholder":
        return _Placeholder()

    def __getattr__(self, name: str) -> "_Placeholder":
        return _Placeholder()


def __getattr__(name: str) -> _Placeholder:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder()
