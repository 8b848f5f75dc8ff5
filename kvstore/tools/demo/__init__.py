"""The ``kvstore demo`` command: prefill reuse with an HF Llama on real text (``python -m kvstore.tools.demo``)."""

from kvstore.tools.demo.cli import add_arguments, main, register, run

__all__ = ["add_arguments", "main", "register", "run"]
