"""The `agentrl` command (also `python -m agentrl`): train, eval, view, plot. Each subcommand is a thin shell:
its flags are shorthands for config keys, and any key can be set as `--section.key=value`."""

from __future__ import annotations

import argparse
import json
import sys

# Shorthand flag → config key; everything else is passed as `--section.key=value`.
TRAIN_FLAGS = {"model": "model.name", "max_steps": "steps", "data": "env.data", "run_dir": "checkpoint.run_dir"}
EVAL_FLAGS = {"model": "model.name", "data": "env.data", "split": "split", "limit": "limit", "out": "out",
              "max_turns": "rollout.max_turns", "max_new_tokens": "rollout.max_new_tokens",
              "temperature": "rollout.temperature", "rollouts_in_flight": "rollout.rollouts_in_flight",
              "device": "device", "dtype": "model.dtype", "seed": "seed"}
# Flags of earlier releases, and the name each knob has now.
RENAMED_FLAGS = {"--max-tokens-per-turn": "--max-new-tokens", "--max-total-tokens": "--rollout.max_sample_tokens"}


def _overrides(parser: argparse.ArgumentParser, known: argparse.Namespace, flags: dict, rest: list[str]) -> list[str]:
    out = [f"--{key}={getattr(known, flag)}" for flag, key in flags.items() if getattr(known, flag) is not None]
    for item in rest:
        name = item.split("=", 1)[0]
        if name in RENAMED_FLAGS:
            parser.error(f"{name} is now {RENAMED_FLAGS[name]}")
        if not item.startswith("--") or "=" not in item:
            parser.error(f"unrecognised argument {item!r}: overrides look like --section.key=value")
        out.append(item)
    return out


def _env_args(parser: argparse.ArgumentParser, items: list[str]) -> list[str]:
    """`--env-arg KEY=VALUE` items as `--env.args.KEY=VALUE` overrides (values read as YAML scalars)."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--env-arg {item!r}: expected KEY=VALUE")
        out.append(f"--env.args.{key}={value}")
    return out


def parse_train(argv: list[str], base: dict | None = None):
    from agentrl.run.config import TrainConfig

    p = argparse.ArgumentParser(prog="agentrl train", description="GRPO training of a tool-using agent.",
                                epilog="Any config key can be set as --section.key=value (e.g. --optim.lr=1e-6).")
    p.add_argument("env", help="environment: a name (hotpotqa_search, gsm8k_math, or one `agentrl envs` lists), "
                               "module:Class, or path/to/file.py:Class")
    p.add_argument("--model", default=None, help="hub id, local dir, a .gguf file (or a dir holding one), tiny-qwen3, or smollm2-135m-instruct")
    p.add_argument("--config", default=None, help="YAML file of config sections")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--data", default=None, help="local json/jsonl path; default: the environment's built-in data")
    p.add_argument("--run-dir", default=None, help="default: runs/<env>")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true",
                       help="continue the run in --run-dir even though its saved config differs (by default a run "
                            "dir with a checkpoint is resumed only when its config matches, and refused otherwise)")
    group.add_argument("--overwrite", action="store_true", help="start afresh, replacing the run dir's checkpoints")
    known, rest = p.parse_known_args(argv)
    overrides = [f"--env.name={known.env}", *_overrides(p, known, TRAIN_FLAGS, rest)]
    if known.run_dir is None and not any(a.startswith("--checkpoint.run_dir=") for a in rest):
        from agentrl.env.loading import run_name

        overrides.insert(1, f"--checkpoint.run_dir=runs/{run_name(known.env)}")
    if known.config:
        cfg = TrainConfig.from_yaml(known.config, overrides, base=base)
    else:
        cfg = TrainConfig.from_dict({}, overrides, base=base)
    return cfg, "resume" if known.resume else "overwrite" if known.overwrite else "auto"


def parse_eval(argv: list[str], base: dict | None = None):
    from agentrl.run.config import EvalConfig

    p = argparse.ArgumentParser(prog="agentrl eval", description="Evaluate a model's tool use and answers offline.",
                                epilog="Any config key can be set as --section.key=value (e.g. --engine.page_size=32). "
                                       "`agentrl eval --compare BEFORE.jsonl AFTER.jsonl [--json]` compares two --out "
                                       "files instead (paired bootstrap over questions; no model).")
    p.add_argument("env", help="environment: a name (hotpotqa_search, gsm8k_math, or one `agentrl envs` lists), "
                               "module:Class, or path/to/file.py:Class")
    p.add_argument("--model", default=None, help="hub id, local dir, a .gguf file (or a dir holding one), or smollm2-135m-instruct (embedded, default)")
    p.add_argument("--data", default=None, help="local json/jsonl path, or 'hub'; default: built-in data")
    p.add_argument("--split", default=None, help="default: dev")
    p.add_argument("--limit", default=None, help="questions to evaluate (default 50; 'none': all)")
    p.add_argument("--out", default=None, help="write every trajectory to this JSONL file")
    p.add_argument("--max-turns", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None, help="per turn")
    p.add_argument("--temperature", type=float, default=None, help="default 0: greedy")
    p.add_argument("--rollouts-in-flight", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument of the environment (repeatable), e.g. --env-arg few_shot=2")
    known, rest = p.parse_known_args(argv)
    overrides = [f"--env.name={known.env}", *_env_args(p, known.env_arg), *_overrides(p, known, EVAL_FLAGS, rest)]
    return EvalConfig.from_dict({}, overrides, base=base)


def cpu_sized(parse, argv: list[str], cfg, parsed, prog: str):
    """(`parsed` again from the CPU-sized defaults when no accelerator is present, the line saying which values that
    set, or "") — the line is printed once the run is sure to start."""
    import torch

    from agentrl.run.config import CPU_SIZED_EVAL, CPU_SIZED_TRAIN, TrainConfig

    if torch.cuda.is_available():
        return parsed, ""
    base = CPU_SIZED_TRAIN if isinstance(cfg, TrainConfig) else CPU_SIZED_EVAL
    again = parse(argv, base=base)
    sized = again[0] if isinstance(again, tuple) else again
    taken = [f"{section}.{key}={value}" for section, values in base.items() for key, value in values.items()
             if getattr(getattr(sized, section), key) == value != getattr(getattr(cfg, section), key)]
    line = f"{prog}: no GPU, so CPU-sized defaults: {' '.join(taken)} (set any of them to override)" if taken else ""
    return again, line


def _train(argv: list[str]) -> int:
    from agentrl.config import ConfigError
    from agentrl.run.preflight import check_inputs, locate_in_config, one_line, parse_one_line

    try:
        cfg, mode = parse_one_line(parse_train, argv, "agentrl train")  # a bad config fails here
        check_inputs(cfg)  # ... and a bad environment or data file here: before torch is imported
        (cfg, mode), sized = cpu_sized(parse_train, argv, cfg, (cfg, mode), "agentrl train")
        from agentrl.run.run_dir import plan_run

        plan = plan_run(cfg, mode)
    except ConfigError as exc:
        print(f"agentrl train: {locate_in_config(one_line(exc), argv, TRAIN_FLAGS)}", file=sys.stderr)
        return 2
    from agentrl.run.interrupt import Interrupted
    from agentrl.run.train import train

    if sized:
        print(sized, file=sys.stderr)
    try:
        last = train(cfg, plan=plan)
    except Interrupted as exc:
        return exc.exit_code
    except ValueError as exc:  # inputs found wrong once loaded (a missing model, prompts too long): one line
        print(f"agentrl train: {exc}", file=sys.stderr)
        return 2
    from agentrl.run.distributed import main_process

    if main_process():  # one summary line for the run, not one per process
        print(json.dumps(last))
    return 0


def _eval(argv: list[str]) -> int:
    if "--compare" in argv:
        return _eval_compare(argv)
    from agentrl.config import ConfigError
    from agentrl.run.preflight import check_inputs, one_line, parse_one_line

    try:
        cfg = parse_one_line(parse_eval, argv, "agentrl eval")
        check_inputs(cfg)  # a bad environment or data file fails here, before torch is imported
        cfg, sized = cpu_sized(parse_eval, argv, cfg, cfg, "agentrl eval")
    except ConfigError as exc:
        print(f"agentrl eval: {one_line(exc)}", file=sys.stderr)
        return 2
    from agentrl.run.eval import evaluate

    if sized:
        print(sized, file=sys.stderr)
    try:
        print(json.dumps(evaluate(cfg)))
    except ValueError as exc:  # inputs found wrong once loaded (a missing model, prompts too long): one line
        print(f"agentrl eval: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = f"; the finished rollouts are in {cfg.out}" if cfg.out else ""
        print(f"\nagentrl eval: interrupted{kept}", file=sys.stderr)
        return 130
    return 0


def _eval_compare(argv: list[str]) -> int:
    """`agentrl eval --compare BEFORE AFTER`: two result files, no model (nothing here imports torch)."""
    p = argparse.ArgumentParser(prog="agentrl eval --compare",
                                description="Compare two `agentrl eval --out` files metric by metric: means, their "
                                            "difference and 95%% intervals from a paired bootstrap over questions.")
    p.add_argument("--compare", nargs=2, required=True, metavar=("BEFORE", "AFTER"), help="two results JSONL files")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    a = p.parse_args(argv)
    from agentrl.run.compare import CompareError, compare, format_table

    try:
        result = compare(*a.compare, resamples=a.resamples, seed=a.seed)
    except CompareError as exc:
        print(f"agentrl eval: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if a.json else format_table(result))
    return 0


def _view(argv: list[str]) -> int:
    from agentrl.view import write_viewer

    p = argparse.ArgumentParser(prog="agentrl view", description="Write a self-contained HTML page of trajectories.")
    p.add_argument("results", help="a JSONL file written by `agentrl eval --out`")
    p.add_argument("--out", default=None, help="default: the results path with .html")
    a = p.parse_args(argv)
    print(write_viewer(a.results, a.out))
    return 0


def _replay(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="agentrl replay",
                                description="Regenerate one logged rollout of a run and diff it against the log.")
    p.add_argument("run_dir", help="a run directory trained with --metrics.log_samples=true")
    p.add_argument("--sample", required=True, help="a sample id from RUN_DIR/samples.jsonl, e.g. g12m3")
    a = p.parse_args(argv)
    from agentrl.run.replay import replay

    try:
        diffs = replay(a.run_dir, a.sample)
    except (FileNotFoundError, KeyError) as exc:
        print(f"agentrl replay: {exc.args[0]}", file=sys.stderr)
        return 2
    for diff in diffs:
        print(diff.line())
    identical = all(d.identical for d in diffs)
    print(f"{a.sample}: {'identical' if identical else 'differs'} ({len(diffs)} turns)")
    return 0 if identical else 1


def _plot(argv: list[str]) -> int:
    from agentrl.train.plot import main

    return main(argv)


def _envs(argv: list[str]) -> int:
    argparse.ArgumentParser(
        prog="agentrl envs", description="List the environments that can be named by their name alone: built-ins "
        "and those installed packages register (entry point group agentrl.environments), one per line with where "
        "it comes from and its tools. Any other is named module:Class or path/to/file.py:Class.").parse_args(argv)
    from agentrl.env.loading import environment_listings, error_line, load_environment

    listings = environment_listings()
    width = max((len(listing.name) for listing in listings), default=0)
    origin_width = max((len(listing.origin) for listing in listings), default=0)
    for listing in listings:
        try:
            tools = ", ".join(load_environment(listing.name).tool_names()) or "(none)"
        except Exception as exc:  # one broken package must not hide the others
            tools = f"(does not load: {error_line(exc)})"
        print(f"{listing.name:<{width}}  {listing.origin:<{origin_width}}  tools: {tools}")
    return 0


COMMANDS = {"train": _train, "eval": _eval, "view": _view, "plot": _plot, "replay": _replay, "envs": _envs}
USAGE = """usage: agentrl {train,eval,view,plot,replay,envs} ...

  train ENV --model M [--config file.yaml] [--key=value ...]   GRPO training with tools
  eval ENV --model M [--data PATH] [--limit N] [--out F.jsonl] offline evaluation
  eval --compare BEFORE.jsonl AFTER.jsonl [--json]            two evaluations' metrics, paired bootstrap intervals
  view RESULTS.jsonl [--out F.html]                           trajectories as one HTML page
  plot RUN_DIR                                                PNG curves of a training run
  replay RUN_DIR --sample ID                                  regenerate a logged rollout, diff it token by token
  envs                                                        environments by name: built-ins and installed ones

ENV is a built-in or installed name (agentrl envs), module:Class, or path/to/file.py:Class."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"agentrl: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


def entrypoint() -> None:
    """The installed `agentrl` command and `python -m agentrl`."""
    from agentrl.parallel.process_exit import exit_process

    exit_process(main())


if __name__ == "__main__":
    entrypoint()
