"""kvtrace: FP8 vs NVFP4 KV-cache comparisons from Nsight Systems traces."""

__version__ = "0.1.0"
