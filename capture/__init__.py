"""Matched FP8 / NVFP4 captures under Nsight Systems. Standard library plus each engine's own packages."""
