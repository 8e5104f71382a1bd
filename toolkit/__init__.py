"""onnxformer toolkit: the PyTorch reference Transformer, checkpoints, tasks, parity, benchmarks and CLI."""
