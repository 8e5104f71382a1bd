"""onnxformer exporters: PyTorch model -> ONNX graphs -> bundle (export, validation, bundle writing, optimization)."""
