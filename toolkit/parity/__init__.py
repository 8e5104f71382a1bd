"""Parity between PyTorch and ONNX Runtime: the tolerance table and the per-graph comparison."""
