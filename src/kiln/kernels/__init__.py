"""Triton kernels, each beside the eager reference it is tested against.

Every op module follows one order: reference -> Triton kernel -> launcher -> autograd Function ->
public op. The public op picks its path through `kiln.kernels.dispatch`.
"""
