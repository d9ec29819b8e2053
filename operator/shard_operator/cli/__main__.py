"""`python -m shard_operator.cli`: shardctl without its script (the Makefile and the tests)."""

import sys

from .main import main

sys.exit(main())
