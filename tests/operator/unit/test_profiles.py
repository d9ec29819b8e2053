"""Where the operator finds a model's profile: files it can read, or a profiling Pod's output."""

from __future__ import annotations

import os

import pytest

from shard_operator.api import SpecError
from shard_operator.reconcile.profiles import LocalProfiles, ModelNotFound, local_model_dir
from shard_operator.settings import Settings
from tests.operator.conftest import make_spec
from tests.support.cluster import write_model


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
    assert profiles.get(model).shape.num_layers == 6
    with pytest.raises(ModelNotFound, match="does not exist"):
        profiles.get(tmp_path / "absent")


def test_a_model_path_that_leads_out_of_its_volume_is_refused_with_one_message(tmp_path):
    """Through a symlink in the volume (the spec itself cannot say '..'), whether the target exists
    or not, and an absolute link that would lead into the operator's own filesystem."""
    node = tmp_path / "node"  # the node's filesystem, mounted at the host path prefix
    volume = node / "data" / "models"
    write_model(volume / "tiny")
    write_model(tmp_path / "operator-own" / "model")
    (volume / "inside").symlink_to("tiny")
    (volume / "exists").symlink_to(tmp_path / "operator-own" / "model")
    (volume / "absent").symlink_to(tmp_path / "nothing")
    (volume / "up").symlink_to("../..")  # the node's root: inside the node, outside the volume
    settings = Settings(host_path_prefix=str(node))
    def spec(path):
        return make_spec(model={"path": path, "volume": {"hostPath": {"path": "/data/models"}}})
    assert local_model_dir(spec("inside"), settings) == (volume / "tiny").resolve()
    for path in ("exists", "absent", "exists/sub", "up/data"):
        with pytest.raises(SpecError, match=r"^spec\.model\.path must stay inside the volume$"):
            local_model_dir(spec(path), settings)
    (tmp_path / "pvcs" / "claim").mkdir(parents=True)
    (tmp_path / "pvcs" / "claim" / "w").symlink_to(tmp_path / "operator-own" / "model")
    with pytest.raises(SpecError, match=r"^spec\.model\.path must stay inside the volume$"):
        local_model_dir(make_spec(model={"path": "w", "volume": {"pvc": {"claimName": "claim"}}}),
                        Settings(pvc_root=str(tmp_path / "pvcs")))


def test_a_hostpath_volume_that_leads_out_of_the_node_is_refused(tmp_path):
    node = tmp_path / "node"
    node.mkdir()
    (node / "data").symlink_to(tmp_path)  # absolute on the node: here it would be the operator's own
    with pytest.raises(SpecError,
                       match=r"^spec\.model\.volume\.hostPath\.path must stay inside the node's filesystem$"):
        local_model_dir(make_spec(model={"path": "tiny", "volume": {"hostPath": {"path": "/data/models"}}}),
                        Settings(host_path_prefix=str(node)))
