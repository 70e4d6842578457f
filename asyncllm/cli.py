"""`asyncllm serve | chat | bench throughput | bench serve`."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[1] / "bench" / "throughput.py"
_COMMANDS = {
    "serve": "the OpenAI-compatible server (same flags as python -m asyncllm.serve)",
    "chat": "a conversation with a model in the terminal, through LLM.chat",
    "bench throughput": "offline throughput against the floor and HF (bench/throughput.py; "
    "plain `bench` runs it too)",
    "bench serve": "an HTTP load generator against a running server (bench/serving.py)",
}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncllm",
        description="An LLM inference engine and OpenAI-compatible server. "
        "`asyncllm COMMAND --help` lists a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"asyncllm {version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, text in _COMMANDS.items():
        commands.add_parser(name, help=text, add_help=False)
    return parser


def version() -> str:
    try:
        return importlib.metadata.version("asyncllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": _serve, "chat": _chat, "bench": _bench}
    if argv and argv[0] in commands:
        commands[argv[0]](argv[1:])  # each command parses (and documents) its own flags
        return
    parser = make_parser()
    parser.parse_args(argv)  # --help and --version exit here, an unknown command with an error
    parser.print_help(sys.stderr)
    sys.exit(2)


def _serve(argv: list[str]) -> None:
    from asyncllm import serve

    serve.main(argv, prog="asyncllm serve")


def _chat(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="asyncllm chat",
        description="chat with a model",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="HF folder or GGUF (None: SmolLM2-135M)")
    parser.add_argument("--system", default=None, help="a system prompt")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="reply length (None: the model's default)"
    )
    parser.add_argument("--temperature", type=float, default=None, help="None: the model's default")
    parser.add_argument("--seed", type=int, default=None, help="for reproducible replies")
    args = parser.parse_args(argv)

    from asyncllm import LLM

    llm = LLM(model=args.model)
    params = llm.get_default_sampling_params()
    params.seed = args.seed
    params.temperature = params.temperature if args.temperature is None else args.temperature
    params.max_tokens = params.max_tokens if args.max_tokens is None else args.max_tokens
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("an empty line or Ctrl-D ends the chat", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        print(reply)


def _bench(argv: list[str]) -> None:
    """`bench serve ...`: bench/serving.py; `bench throughput ...` or `bench ...`: throughput.py."""
    scripts = {"throughput": _BENCH, "serve": _BENCH.with_name("serving.py")}
    name = argv[0] if argv and argv[0] in scripts else "throughput"
    argv = argv[1:] if argv and argv[0] == name else argv
    script = scripts[name]
    if not script.exists():
        sys.exit(f"asyncllm bench needs a source checkout: {script} is missing")
    spec = importlib.util.spec_from_file_location(f"asyncllm_bench_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    sys.argv = [str(script), *argv]
    print(f"asyncllm bench {name}: {script}", file=sys.stderr)
    module.main()


if __name__ == "__main__":
    main()
