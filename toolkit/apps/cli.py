"""The `onnxformer` command line: a thin layer over library functions.

Each command lives in toolkit/apps/commands/<module>.py as `command`. The group imports a command's module only when
that command runs (or when --help lists them all), so `onnxformer generate` loads what generating needs and not
the code of the other commands (the peak resident memory of generate on an edge device). Commands
import torch, onnx and onnxscript only inside their bodies, so the runtime commands (generate, inspect, bench on
bundles) work where only numpy, onnxruntime and click are installed.

Exit codes: 0 success; 1 a check failed (parity out of tolerance); 2 a usage or input error, with a
one-line message that names the problem and the fix.
"""

from __future__ import annotations

import importlib

import click

COMMANDS = {"init": "init", "train": "train", "import": "importer", "export": "export", "optimize": "optimize",
            "generate": "generate", "parity": "parity", "bench": "bench", "inspect": "inspect", "demo": "demo",
            "serve": "serve", "loadtest": "loadtest", "score": "score",
            "shortlist": "shortlist", "transcribe": "transcribe", "web": "web"}   # command name -> module in toolkit/commands


class LazyGroup(click.Group):
    """A click group whose commands are imported on first use; a command whose module is absent is not offered."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if self.get_command(ctx, name) is not None)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in COMMANDS:
            module_name = f"toolkit.apps.commands.{COMMANDS[name]}"
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name != module_name:
                    raise
                return None
            self.add_command(module.command, name)
        return self.commands.get(name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="onnxformer")
def main():
    """Export a seq2seq Transformer to KV-cached ONNX graphs, optimize them, and run them with ONNX Runtime.

    \b
    Pipeline:  [Marian / nn.Transformer --import-->] checkpoint --export--> bundle --optimize--> bundle
    Both checkpoints (PyTorch) and bundles (ONNX Runtime) can be passed to generate and bench.
    """


if __name__ == "__main__":
    main()
