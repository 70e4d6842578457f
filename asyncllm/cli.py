"""`asyncllm serve | chat | bench`.

serve: the OpenAI-compatible server (same flags as `python -m asyncllm.serve`).
chat:  a small interactive conversation with a model through LLM.chat.
bench: bench/throughput.py's main, with the remaining flags.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[1] / "bench" / "throughput.py"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": _serve, "chat": _chat, "bench": _bench}
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    commands[argv[0]](argv[1:])


def _serve(argv: list[str]) -> None:
    from asyncllm import serve

    serve.main(argv, prog="asyncllm serve")


def _chat(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="asyncllm chat", description="chat with a model")
    parser.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2-135M)")
    parser.add_argument("--system", default=None, help="a system prompt")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)

    from asyncllm import LLM, SamplingParams

    llm = LLM(model=args.model)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
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
    module.main()


if __name__ == "__main__":
    main()
