"""Trace, partition, artifact, cache: turning a model into a stored compiled forward and back.

Entry points: `build.load_or_compile` (runtime), `build.compile_model` (`atomc compile`); the
`atomc cache` commands are in atomc/cli/cache.py.
"""
