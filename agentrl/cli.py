"""The `agentrl` command: train, eval, view, plot. Each subcommand is a thin shell over one module."""

from __future__ import annotations

import argparse
import json
import sys


def _eval(argv: list[str]) -> int:
    from agentrl.eval import EvalConfig, evaluate

    p = argparse.ArgumentParser(prog="agentrl eval", description="Evaluate a model's tool use and answers offline.")
    p.add_argument("env", help="environment name, e.g. hotpotqa_search or gsm8k_math")
    p.add_argument("--model", default=EvalConfig.model, help="hub id, local dir, or smollm2-135m-instruct (embedded)")
    p.add_argument("--data", default=None, help="local json/jsonl path, or 'hub'; default: built-in data")
    p.add_argument("--split", default=EvalConfig.split)
    p.add_argument("--limit", type=int, default=EvalConfig.limit)
    p.add_argument("--out", default=None, help="write every trajectory to this JSONL file")
    p.add_argument("--max-turns", type=int, default=EvalConfig.max_turns)
    p.add_argument("--max-tokens-per-turn", type=int, default=EvalConfig.max_tokens_per_turn)
    p.add_argument("--max-total-tokens", type=int, default=EvalConfig.max_total_tokens)
    p.add_argument("--temperature", type=float, default=EvalConfig.temperature)
    p.add_argument("--rollouts-in-flight", type=int, default=EvalConfig.rollouts_in_flight)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument of the environment (repeatable), e.g. --env-arg few_shot=2")
    a = p.parse_args(argv)
    options = vars(a)
    options["env_args"] = _env_args(p, options.pop("env_arg"))
    summary = evaluate(EvalConfig(**{k.replace("-", "_"): v for k, v in options.items()}))
    print(json.dumps(summary))
    return 0


def _env_args(parser: argparse.ArgumentParser, items: list[str]) -> dict:
    """`KEY=VALUE` items, each value read as the train config reads `rollout.env_args` (so `2` is an int)."""
    from agentrl.train.config import ConfigError, parse_value

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--env-arg {item!r}: expected KEY=VALUE")
        try:
            out[key] = parse_value(value, f"--env-arg {key}")
        except ConfigError as exc:
            parser.error(str(exc))
    return out


def _view(argv: list[str]) -> int:
    from agentrl.view import write_viewer

    p = argparse.ArgumentParser(prog="agentrl view", description="Write a self-contained HTML page of trajectories.")
    p.add_argument("results", help="a JSONL file written by `agentrl eval --out`")
    p.add_argument("--out", default=None, help="default: the results path with .html")
    a = p.parse_args(argv)
    print(write_viewer(a.results, a.out))
    return 0


def _train(argv: list[str]) -> int:
    from agentrl.train.loop import main

    return main(argv)


def _plot(argv: list[str]) -> int:
    from agentrl.train.plot import main

    return main(argv)


COMMANDS = {"train": _train, "eval": _eval, "view": _view, "plot": _plot}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: agentrl {train,eval,view,plot} ...\n\n"
              "  train ENV --model M [--config file.yaml] [--key=value ...]   GRPO training with tools\n"
              "  eval ENV --model M [--data PATH] [--limit N] [--out F.jsonl] offline evaluation\n"
              "  view RESULTS.jsonl [--out F.html]                           trajectories as one HTML page\n"
              "  plot RUN_DIR                                                PNG curves of a training run")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
