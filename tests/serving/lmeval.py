"""EleutherAI's lm-eval, run from its own virtual environment, cached outside the repository.

lm-eval pins python-dateutil < 3 where the kubernetes client needs >= 3, so it cannot share the
project's .venv. It needs nothing of ours in-process: it is a client of a served model (its
`local-completions` model against /v1/completions), so it gets a venv of its own under
~/.cache/shard-operator, made once per machine with pip from the registry (a pinned version, no
torch: the `api` extra and transformers for the tokenizer), by `make test-tools` or by the first
test that needs it, as tests/packaging/scanner.py does for checkov.

This file is also the script that venv runs (`python lmeval.py TASKS_DIR MODEL_ARGS OUT`): only the
standard library is imported at the top, lm_eval inside `_evaluate`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VERSION = "0.4.13"
REQUIREMENTS = [f"lm-eval[api]=={VERSION}", "transformers==5.25.0"]
TASKS = Path(__file__).with_name("lmeval_tasks")  # the task YAMLs and their data, relative to it
# Nothing from the hubs: the task's data is a local JSON file, the tokenizer a local directory.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}


def install() -> Path:
    """Make lm-eval's venv if this machine has none (a few minutes the first time); its python."""
    from tests.support import toolvenv  # here, not at the top: lm-eval's venv runs this file as a script

    return toolvenv.ensure(f"lm-eval-{VERSION}", REQUIREMENTS, timeout=1200)


def evaluate(tasks: list[str], workdir: Path, *, model_args: str, timeout: float = 900) -> dict:
    """lm-eval's `results` for `tasks` (defined in lmeval_tasks/) against `model_args`'s server, and
    its `samples` (per task: each request's `arguments` and the `filtered_resps` it parsed)."""
    out = workdir / "lm-eval-results.json"
    result = subprocess.run(
        [str(install()), "-I", str(Path(__file__).resolve()), ",".join(tasks), model_args, str(out)],
        cwd=TASKS, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **OFFLINE_ENV, "HF_HOME": str(workdir / "hf-home")})
    if result.returncode != 0:
        raise RuntimeError(f"lm-eval failed (exit {result.returncode}):\n{result.stderr[-6000:]}")
    return json.loads(out.read_text())


def _evaluate(tasks: str, model_args: str, out: str) -> None:  # runs inside lm-eval's venv
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model="local-completions", tasks=tasks.split(","), model_args=model_args,
                                      task_manager=TaskManager(include_path=str(TASKS)), log_samples=True)
    samples = {task: [{"arguments": s["arguments"], "filtered_resps": s["filtered_resps"]} for s in rows]
               for task, rows in results["samples"].items()}
    Path(out).write_text(json.dumps({"results": results["results"], "samples": samples}, default=str))


if __name__ == "__main__":
    if len(sys.argv) == 4:
        _evaluate(*sys.argv[1:])
    else:
        print(install())
