"""A sharded checkpoint consolidated, zeroshard vs its framework's own tool.

Run as `python -m benchmarks.consolidate`; see `__main__.py`.
"""
