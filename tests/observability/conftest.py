"""A running TP=2 x PP=2 group of the tiny demo model (real `python -m shard_worker` ranks started by
`LocalGroup`, the launcher of `shardctl run`), and a real headless Chromium.

The group is shared by the module's tests, which run in file order: the one that kills a rank
comes last.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from shard_operator.local.demo_model import write_demo_model
from shard_operator.local.launcher import LocalGroup, free_port, plan_local
from shard_operator.local.run import wait_ready
from tests.serving.conftest import TINY
from tests.support.browser import Browser

MODEL = "tiny"
# Set to a folder (docs/) to keep the pages' screenshots there.
SCREENSHOTS = os.environ.get("SHARD_SCREENSHOTS")


@dataclass
class Group:
    url: str
    launcher: LocalGroup

    def shards(self) -> dict:
        return httpx.get(self.url + "/v1/shards", timeout=10).json()

    def complete(self, n: int, max_tokens: int = 12) -> None:
        for i in range(n):
            self.complete_prompt(f"The {i}", max_tokens)

    def complete_prompt(self, prompt: str, max_tokens: int = 12) -> None:
        response = httpx.post(self.url + "/v1/completions", timeout=60,
                              json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
        assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("observability") / MODEL, TINY)


@pytest.fixture(scope="module")
def group(tiny_model, tmp_path_factory):
    plan = plan_local(tiny_model, 2, 2, max_model_len=256, max_batch_size=4, devices="localhost:160MiB*4",
                      device_kind="cpu")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with LocalGroup(plan, tiny_model, tmp_path_factory.mktemp("group"), leader_port=port, threads_per_rank=1,
                    extra_env={"SHARD_HOST": "127.0.0.1", "SHARD_MODEL_NAME": MODEL}) as launcher:
        wait_ready(launcher, url, 300)
        yield Group(url, launcher)


@pytest.fixture
def browser():
    with Browser(1280, 900) as b:
        yield b
    assert not b.errors, f"the page's scripts threw: {b.errors}"


def keep_screenshot(browser: Browser, tmp_path: Path, name: str) -> Path:
    path = browser.screenshot(tmp_path / name)
    if SCREENSHOTS:
        browser.screenshot(Path(SCREENSHOTS) / name)
    return path
