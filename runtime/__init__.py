"""onnxformer runtime: load a bundle and generate with ONNX Runtime. Imports only numpy and onnxruntime."""
