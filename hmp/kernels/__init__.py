"""Compute kernels that run inside a worker: pure torch, no sockets, no nodes.

``hmp.kernels.fused`` holds the horizontally fused training arrays (HFTA): B copies of one
model trained at once as one wider model (see docs/hfta.md).
"""
