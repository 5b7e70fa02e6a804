"""Fast CPU paths of the ops whose references are too slow to serve with: vectorized PyTorch, dispatched by
`kestrel.ops` for CPU tensors; each is tested against its `*_ref` oracle in `kernels/`."""
