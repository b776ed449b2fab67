"""zeroshard.compile (being built; see the package README)."""

__all__: list[str] = []
