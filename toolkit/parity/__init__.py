"""Parity between PyTorch and ONNX Runtime: the tolerance table, the per-graph comparison, generation parity."""

from runtime.errors import OnnxformerError


class ParityError(OnnxformerError):
    """Parity out of tolerance: a check failed (exit code 1)."""

    exit_code = 1

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report
