"""Command-line entry points that are only commands (``vllm-treespec serve``,
``demo``, ``npu-check``); ``cli.py`` dispatches to them. Commands that are also
libraries (``assets``, ``bench``, ``train``) live with their code."""
