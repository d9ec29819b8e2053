"""`shardctl`, one module per family of commands: `planning` (plan, manifests, crd), `running`
(run, generate, status), `tools` (demo-model, completion); `options` holds what they share and
`main` the parser and the entry point."""

from .main import build_parser, main
from .options import EXIT_BAD_INPUT, EXIT_INFEASIBLE, EXIT_RANKS_FAILED, inventory_for

__all__ = ["EXIT_BAD_INPUT", "EXIT_INFEASIBLE", "EXIT_RANKS_FAILED", "build_parser", "inventory_for", "main"]
