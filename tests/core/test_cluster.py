from __future__ import annotations

import math

import pytest

from autoplace.cluster import PRESETS, Cluster, parse_bytes, preset, resolve
from autoplace.errors import AutoplaceError


def test_presets_named_in_issue():
    for name in ("h100x2", "h100x8", "h200x2", "a100-pcie-x4", "cpu-x2"):
        c = preset(name)
        assert c.num_devices == int(name.rsplit("x", 1)[1])


def test_unknown_preset_lists_valid():
    with pytest.raises(AutoplaceError, match="valid: .*h100x2"):
        resolve("h900x2")


def test_memory_cap_and_json(tmp_path):
    c = resolve("h200x2", memory_cap="16GB")
    assert all(d.usable_memory_bytes == 16 * 2**30 for d in c.devices)
    path = tmp_path / "c.json"
    c.save(path)
    again = resolve(str(path))
    assert again == c
    # strict JSON: the infinite self-links are null in the file, infinite again when read
    text = path.read_text()
    assert "Infinity" not in text and "null" in text
    assert all(math.isinf(again.bandwidth[i][i]) for i in range(again.num_devices))


def test_strict_json_replaces_non_finite_floats():
    from autoplace.plan import strict_json

    assert strict_json({"a": [1.0, math.inf, (math.nan, 2)], "b": "x"}) == {
        "a": [1.0, None, [None, 2]], "b": "x"}


def test_parse_bytes():
    assert parse_bytes("16GB") == 16 * 2**30
    assert parse_bytes("512 MB") == 512 * 2**20
    assert parse_bytes("1.5g") == int(1.5 * 2**30)
    with pytest.raises(AutoplaceError, match="like 16GB"):
        parse_bytes("lots")


def test_transfer_time_is_alpha_plus_bytes_over_bandwidth():
    c = Cluster.uniform("t", preset("cpu-x1").devices[0], 4, alpha_s=1e-5, bandwidth=1e9)
    assert c.transfer_time(0, 1, 1e8) == pytest.approx(1e-5 + 1e8 / 1e9)
    assert c.transfer_time(1, 1, 1e8) == 0.0


def test_detect_on_cpu():
    c = Cluster.detect()
    assert c.num_devices >= 1
    assert len(PRESETS) >= 10
