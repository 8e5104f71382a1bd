"""The applications: the onnxformer command line, the server, benchmarks and the demo (the top layer)."""
