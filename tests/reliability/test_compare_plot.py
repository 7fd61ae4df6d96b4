"""compare's and the demo's bar charts have bars; out-of-memory rows have no ratio."""

from __future__ import annotations

import pytest
from matplotlib.patches import Rectangle

from autoplace import viz, workloads
from autoplace.capture import capture_workload
from autoplace.cli import main
from autoplace.cluster import preset
from autoplace.errors import AutoplaceError
from autoplace.search.compare import compare, format_table


@pytest.fixture
def drawn(monkeypatch):
    """The figures viz saves, kept to count their bars."""
    figures = []
    save = viz._save

    def keep(fig, path):
        figures.append([p for ax in fig.axes for p in ax.patches if isinstance(p, Rectangle)])
        return save(fig, path)

    monkeypatch.setattr(viz, "_save", keep)
    return figures


def test_compare_plot_has_bars(tmp_path, drawn, capsys):
    plot = tmp_path / "bars.png"
    assert main(["compare", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--planners",
                 "single,expert,ddp", "--plot", str(plot)]) == 0
    bars = drawn[-1]
    assert len(bars) == 3 and all(b.get_height() > 0 for b in bars)
    assert plot.stat().st_size > 5000


def test_the_demos_chart_reads_the_rows_it_is_given(tmp_path, drawn):
    graph = capture_workload(workloads.get("gpt-tiny", device="meta"))
    rows = compare(graph, preset("cpu-x2"), ["single", "ddp"])
    # the call the demo makes (autoplace/demo.py)
    viz.bar_chart(rows, tmp_path / "compare.png", value="sim_step_time_s", scale=1e3,
                  ylabel="simulated step (ms)", title="demo")
    assert [round(b.get_height(), 6) for b in drawn[-1]] == [
        round(r["sim_step_time_s"] * 1e3, 6) for r in rows]
    with pytest.raises(AutoplaceError, match="no row has the value 'step_time_s'"):
        viz.bar_chart(rows, tmp_path / "empty.png")  # the old default: an empty chart


def test_out_of_memory_rows_have_no_ratio_to_the_best():
    graph = capture_workload(workloads.get("gpt-tiny", device="meta"))
    single = compare(graph, preset("cpu-x2"), ["single"])[0]
    cap = int(max(single["peak_memory_bytes"]) * 0.75)  # single does not fit, expert does
    rows = compare(graph, preset("cpu-x2").with_memory_cap(cap), ["single", "expert"])
    by = {r["planner"]: r for r in rows}
    assert by["single"]["oom"] and not by["expert"]["oom"], rows
    assert by["single"]["ratio_to_best"] is None and by["expert"]["ratio_to_best"] == 1.0
    line = next(x for x in format_table(rows).splitlines() if x.startswith("| single"))
    cells = [c.strip() for c in line.split("|")]
    assert "OOM" in cells and cells[4] == "", "the x best column is empty on an OOM row"
