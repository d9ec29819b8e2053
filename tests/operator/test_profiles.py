"""Where the operator finds a model's profile: files it can read, or a profiling Pod's output."""

from __future__ import annotations

import os

import pytest

from shard_operator.profiles import LocalProfiles, ModelNotFound, local_model_dir
from shard_operator.settings import Settings

from tests.support.cluster import write_model

from .conftest import make_spec


@pytest.mark.parametrize("volume,settings,expected", [
    ({"hostPath": {"path": "/data/models"}}, Settings(host_path_prefix=""), "/data/models/tiny"),
    ({"hostPath": {"path": "/data/models"}}, Settings(host_path_prefix="/host"), "/host/data/models/tiny"),
    ({"hostPath": {"path": "/data/models"}}, Settings(), None),  # the operator cannot see hostPaths
    ({"pvc": {"claimName": "weights"}}, Settings(pvc_root="/mnt/pvcs"), "/mnt/pvcs/weights/tiny"),
    ({"pvc": {"claimName": "weights"}}, Settings(host_path_prefix=""), None),
    ({"image": {"reference": "reg/m:1"}}, Settings(host_path_prefix="", pvc_root="/mnt"), None),
])
def test_local_model_dir(volume, settings, expected):
    path = local_model_dir(make_spec(model={"path": "tiny", "volume": volume}), settings)
    assert (str(path) if path else None) == expected


def test_local_profiles_are_cached_until_a_file_changes(tmp_path):
    model = write_model(tmp_path / "tiny")
    profiles = LocalProfiles()
    first = profiles.get(model)
    assert profiles.get(model) is first  # cached
    write_model(tmp_path / "tiny", num_hidden_layers=6)
    os.utime(model / "config.json", ns=(1, 1))  # a new mtime even on a coarse clock
    assert profiles.get(model).num_layers == 6
    with pytest.raises(ModelNotFound, match="does not exist"):
        profiles.get(tmp_path / "absent")
