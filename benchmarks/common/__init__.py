"""Helpers shared by the benchmarks: GPU kernel time from profiler traces (`trace`) and what
compiled HLO text holds (`hlo`). Scripts put the repository root on ``sys.path`` and import
``benchmarks.common``."""
