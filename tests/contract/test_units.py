"""Kubernetes resource quantities, as the API server reads them (the scheduler's sums, and the
memory an offloading rank's pod asks for on top of its own)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from shard_contract.units import quantity


@pytest.mark.parametrize("text, value", [
    ("8Gi", 8 * 2**30), ("16G", 16 * 10**9), ("500M", 500 * 10**6), ("100m", Decimal("0.1")), ("2", 2), (3, 3),
    ("1e3", 1000), (".5Ki", 512), ("1.5Mi", 3 * 2**19), ("250u", Decimal("0.00025")),
])
def test_a_quantity_is_its_number_times_its_suffix(text, value):
    assert quantity(text) == value


@pytest.mark.parametrize("text", ["16GB", "1.5.2Gi", "", "lots", "8 Gi", "8gi"])  # case matters: m is milli
def test_what_the_api_server_refuses_is_refused_saying_how_to_write_it(text):
    with pytest.raises(ValueError, match="is not a Kubernetes quantity; write it like 16Gi"):
        quantity(text)
