"""`python -m shard_operator.profilejob DIR`: print a model's profile as one line of JSON.

Run by the profiling Pod the operator starts when it cannot read the model's volume itself; the
operator reads the line from the pod's log. Only config.json and the safetensors headers are read.
"""

from __future__ import annotations

import sys

from .profile import ProfileError, profile_model


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m shard_operator.profilejob MODEL_DIR", file=sys.stderr)
        return 2
    try:
        profile = profile_model(args[0])
    except (ProfileError, OSError) as err:
        print(f"profile failed: {err}", file=sys.stderr)
        return 1
    print(profile.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
