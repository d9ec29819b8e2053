"""Rendered charts shared by the packaging tests: rendering once per session keeps them fast."""

from __future__ import annotations

import pytest

from .chart import CUSTOM_VALUES, MONITORING_API, render, write_values


@pytest.fixture(scope="session")
def custom_values_file(tmp_path_factory):
    return write_values(tmp_path_factory.mktemp("values") / "custom.yaml", CUSTOM_VALUES)


@pytest.fixture(scope="session")
def default_objects():
    return render()


@pytest.fixture(scope="session")
def custom_objects(custom_values_file):
    return render(custom_values_file, api_versions=MONITORING_API)


@pytest.fixture(scope="session", params=["default", "custom"])
def rendered(request, default_objects, custom_objects):
    """Both renders, as (name, objects)."""
    return request.param, default_objects if request.param == "default" else custom_objects
