"""Helpers around the product: `shardctl demo-model` (a random checkpoint to try everything
offline) and `completion` (the shell completion script, written from the parser)."""

from __future__ import annotations

import argparse
import sys

from ..local.demo_model import DemoShape as DemoShapeDefaults
from .completion import completion_script
from .options import EXIT_BAD_INPUT, command


def cmd_demo_model(args: argparse.Namespace) -> int:
    from ..local.demo_model import DemoShape, describe, write_demo_model

    shape = DemoShape(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
                      kv_heads=args.kv_heads, vocab=args.vocab, max_positions=args.max_positions,
                      files=args.files, seed=args.seed)
    try:
        directory = write_demo_model(args.directory, shape, overwrite=args.force)
    except FileExistsError as err:
        print(f"shardctl: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(describe(directory))
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    sys.stdout.write(completion_script(args.root_parser, args.shell))
    return 0


def add_demo_model(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "demo-model", "write a random Llama checkpoint to try everything offline",
                "Write a random Llama checkpoint (several safetensors files, a trained BPE tokenizer with a "
                "chat\ntemplate): its answers are noise, but everything else runs as with a real model.",
                ["shardctl demo-model .cache/demo-model", "shardctl demo-model /tmp/tiny --layers 4 --hidden 64 "
                                                          "--intermediate 128 --heads 4 --kv-heads 2"])
    p.add_argument("directory", help="where to write it (created; must be empty unless --force)")
    defaults = DemoShapeDefaults()
    p.add_argument("--layers", type=int, metavar="N", default=defaults.layers, help="decoder layers")
    p.add_argument("--hidden", type=int, metavar="N", default=defaults.hidden, help="hidden size")
    p.add_argument("--intermediate", type=int, metavar="N", default=defaults.intermediate, help="MLP width")
    p.add_argument("--heads", type=int, metavar="N", default=defaults.heads, help="attention heads")
    p.add_argument("--kv-heads", type=int, metavar="N", default=defaults.kv_heads, help="key/value heads")
    p.add_argument("--vocab", type=int, metavar="N", default=defaults.vocab,
                   help="most tokens of the trained tokenizer")
    p.add_argument("--max-positions", type=int, metavar="N", default=defaults.max_positions,
                   help="max_position_embeddings")
    p.add_argument("--files", type=int, metavar="N", default=defaults.files,
                   help="safetensors files to split the weights into")
    p.add_argument("--seed", type=int, metavar="N", default=defaults.seed, help="seed of the random weights")
    p.add_argument("--force", action="store_true", help="replace what the directory holds")
    p.set_defaults(func=cmd_demo_model)


def add_completion(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "completion", "print a shell completion script",
                "Print a completion script for the shell: subcommands, their flags, the choices of a flag, "
                "and file\nnames where a flag takes a file. zsh reads the bash one after "
                "`autoload -U bashcompinit && bashcompinit`.",
                ["source <(shardctl completion bash)", "shardctl completion bash > ~/.local/share/"
                                                       "bash-completion/completions/shardctl"])
    p.add_argument("shell", choices=("bash",), help="the shell")
    p.set_defaults(func=cmd_completion)
