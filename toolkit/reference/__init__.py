"""The reference side: the PyTorch Transformer, its config, checkpoints, importers and example tasks (torch)."""
