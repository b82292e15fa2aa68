"""dsv4: DeepSeek V4.1 Flash in MLX."""

__all__ = ["load", "generate", "stream_generate"]


def __getattr__(name):
    # Imported on first use, so `python -m dsv4.<module>` finds its module not yet imported.
    if name in __all__:
        from . import generation, loader

        globals().update(load=loader.load, generate=generation.generate,
                         stream_generate=generation.stream_generate)
        return globals()[name]
    raise AttributeError(name)
