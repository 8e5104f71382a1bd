"""The `onnxformer` command line: a thin layer over library functions.

Each command lives in toolkit/commands/<name>.py and registers itself on `main`. Commands import
torch, onnx and onnxscript only inside their bodies, so the runtime commands (generate, inspect,
bench on bundles) work where only numpy, onnxruntime and click are installed.

Exit codes: 0 success; 1 a check failed (parity out of tolerance); 2 a usage or input error, with a
one-line message that names the problem and the fix.
"""

from __future__ import annotations

import importlib

import click

COMMANDS = ("init", "train", "importer", "export", "optimize", "generate", "parity", "bench", "inspect", "demo", "serve",
            "loadtest")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="onnxformer")
def main():
    """Export a seq2seq Transformer to KV-cached ONNX graphs, optimize them, and run them with ONNX Runtime.

    \b
    Pipeline:  [Marian / nn.Transformer --import-->] checkpoint --export--> bundle --optimize--> bundle
    Both checkpoints (PyTorch) and bundles (ONNX Runtime) can be passed to generate and bench.
    """


for _name in COMMANDS:
    try:
        _module = importlib.import_module(f"toolkit.commands.{_name}")
    except ModuleNotFoundError as _exc:
        if _exc.name != f"toolkit.commands.{_name}":
            raise
        continue
    main.add_command(_module.command)

if __name__ == "__main__":
    main()
