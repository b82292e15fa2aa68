"""dsv4: DeepSeek V4.1 Flash in MLX."""

from .loader import load

__all__ = ["load", "generate", "stream_generate"]


def __getattr__(name):
    # generate pulls in sampling code; import it only when asked for.
    if name in ("generate", "stream_generate"):
        from . import generate as _generate

        return getattr(_generate, name)
    raise AttributeError(name)
