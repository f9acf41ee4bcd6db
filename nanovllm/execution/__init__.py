"""The execution layer: model runners on every tensor-parallel rank, their KV caches, step
inputs, CUDA graphs and sampling. The engine reaches it only through its executor."""
