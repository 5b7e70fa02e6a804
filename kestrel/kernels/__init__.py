"""Triton kernels; each module pairs a kernel and its launcher with a PyTorch reference `*_ref`."""
