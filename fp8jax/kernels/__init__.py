"""Fused GPU kernels (Pallas) for the memory-bound passes XLA splits into several kernels.

Each kernel has a pure-XLA reference path that computes the same values; the kernel runs only
on GPUs, and in tests on CPU through Pallas' interpreter.
"""
