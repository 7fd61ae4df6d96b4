"""Measured collective and copy speeds, and the cluster that simulates with them."""

from __future__ import annotations

import pytest

from autoplace.cluster import preset
from autoplace.costs.profile import measure_links
from autoplace.errors import AutoplaceError
from autoplace.executor.collectives import bus_factor, measure_collectives, with_measured_links


def test_measured_collectives_on_two_cpu_ranks_fit_the_cluster_formulas():
    sizes = (2**12, 2**16, 2**20)
    r = measure_collectives(["cpu", "cpu"], sizes=sizes, repeats=3)
    assert r["backend"] == "gloo"
    for kind in ("allreduce", "allgather", "reducescatter"):
        pts = r[kind]["points"]
        assert [n for n, _ in pts] == list(sizes) and all(t > 0 for _, t in pts)
        assert r[kind]["bus_bandwidth"] > 0 and r[kind]["alpha_s"] >= 0
    base = preset("cpu-x2")
    links = measure_links(["cpu", "cpu"], sizes=(2**12, 2**18, 2**21), repeats=3)
    c = with_measured_links(base, links, r)
    assert c.bandwidth[0][1] == links[1][0][1] and c.alpha_s[1][0] == links[0][1][0]
    assert c.collective_bandwidth != base.collective_bandwidth
    # the simulator's all-reduce of 1 MiB now follows the measured speed: alpha steps
    # plus the bus bytes at the measured bus bandwidth
    n = 2**20
    want = 2 * max(c.collective_alpha_s, c.alpha_s[0][1], c.alpha_s[1][0]) \
        + bus_factor("allreduce", 2) * n / c.collective_bandwidth
    assert c.allreduce_time(n) == pytest.approx(want)


def test_collectives_need_two_devices_and_links_must_match_the_cluster():
    with pytest.raises(AutoplaceError, match="at least two devices"):
        measure_collectives(["cpu"])
    with pytest.raises(AutoplaceError, match="3 devices"):
        with_measured_links(preset("cpu-x2"), ([[0.0] * 3] * 3, [[1.0] * 3] * 3), None)
