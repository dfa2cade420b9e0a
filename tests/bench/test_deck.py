"""The run deck from a synthetic report: its panels' numbers, its HTML, and the page as a real
headless browser renders it (the DOM after load, and a screenshot)."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from atomc.bench import deck
from atomc.bench.deck_svg import line_chart, nice_ticks
from tests.bench.deck_report import report

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
SHAPES, PERF_METRICS, CONCS = 2, 3, 5


class Elements(HTMLParser):
    """Tags with their attributes, in document order."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def count(self, tag: str, cls: str | None = None) -> int:
        return sum(t == tag and (cls is None or cls in (a.get("class") or "").split()) for t, a in self.tags)

    def points(self) -> list[dict]:
        return [a for t, a in self.tags if t == "circle" and a.get("class") == "pt"]


def parse(html: str) -> Elements:
    p = Elements()
    p.feed(html)
    return p


def write_inputs(tmp_path: Path) -> tuple[Path, Path]:
    prev, parity = tmp_path / "prev.json", tmp_path / "vllm.json"
    prev.write_text(json.dumps(report(scale=1.25, arith=0.70, niah=0.5)))
    parity.write_text(json.dumps({**report(scale=2.0), "framework": "vllm"}))
    return prev, parity


# --- panels ------------------------------------------------------------------------------------


def test_prev_run_and_parity_panels(tmp_path):
    prev, parity = write_inputs(tmp_path)
    html_path, json_path = deck.write_deck(report(), tmp_path / "deck", prev, parity)
    panels = json.loads(json_path.read_text())["panels"]
    key = "ISL=1024,OSL=1024,TP=1,PP=1,CONC=4"
    [row] = [r for r in panels["prev_run"] if r["cell"] == key]
    assert row["delta_pct"] == pytest.approx((1 / 1.25 - 1) * 100)
    assert row["delta"] == pytest.approx(row["output_throughput"] - row["prev_output_throughput"])
    acc = {r["metric"]: r for r in panels["accuracy_prev_run"]}
    assert acc["arith/atomc_arith.exact_match__flexible-extract"]["delta"] == pytest.approx(0.62 - 0.70)
    assert acc["accuracy.niah_pass_rate__4k"]["delta"] == pytest.approx(0.25)
    assert not any("_stderr" in m for m in acc)  # error bars are not compared
    par = panels["framework_parity"]
    assert par["reference"] == "vllm" and len(par["rows"]) == SHAPES * CONCS
    assert par["rows"][0]["output_throughput_ratio"] == pytest.approx(0.5)
    assert par["rows"][0]["mean_ttft_ms_ratio"] == pytest.approx(1.0)
    html = html_path.read_text()
    assert "Throughput against the previous run" in html and "atomc / vllm" in html


def test_a_cell_missing_from_the_previous_run_has_no_delta():
    now = report()
    prev = report()
    del prev["cells"]["ISL=128,OSL=2048,TP=1,PP=1,CONC=16"]
    rows = {r["cell"]: r for r in deck.prev_run_panel(now, prev)}
    assert rows["ISL=128,OSL=2048,TP=1,PP=1,CONC=16"]["delta"] is None
    assert rows["ISL=128,OSL=2048,TP=1,PP=1,CONC=8"]["delta"] == 0


def test_panels_come_from_the_environment(tmp_path, monkeypatch):
    prev, parity = write_inputs(tmp_path)
    _html, json_path = deck.write_deck(report(), tmp_path / "none")
    assert json.loads(json_path.read_text())["panels"] == {}
    monkeypatch.setenv("CVS_INFERENCE_PREV_REPORT_JSON", str(prev))
    monkeypatch.setenv("CVS_ATOM_PARITY_REF_JSON", str(parity))
    _html, json_path = deck.write_deck(report(), tmp_path / "env")
    full = json.loads(json_path.read_text())
    assert set(full["panels"]) == {"prev_run", "accuracy_prev_run", "framework_parity"}
    assert full["panels_inputs"] == {"prev_report": str(prev), "parity_ref": str(parity)}


def test_an_unreadable_comparison_input_says_which(tmp_path):
    with pytest.raises(ValueError, match="previous report"):
        deck.write_deck(report(), tmp_path, prev_path=tmp_path / "missing.json")


# --- the page ----------------------------------------------------------------------------------


def test_page_has_every_part_and_loads_nothing(tmp_path):
    prev, parity = write_inputs(tmp_path)
    html = deck.write_deck(report(), tmp_path / "deck", prev, parity)[0].read_text()
    page = parse(html)
    ids = {a.get("id") for _t, a in page.tags if a.get("id")}
    assert ids >= {"summary", "gates", "perf", "blocks", "accuracy", "long_context", "platform", "panels"}
    # no script, no external resource: the page works offline, on its own
    assert page.count("script") == 0 and page.count("link") == 0 and page.count("img") == 0
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "").replace("http://127.0.0.1:8000", "")
    assert "https://" not in html
    # 3 perf charts per shape + 3 platform charts (power, clock, temperature)
    assert page.count("svg", "chart") == SHAPES * PERF_METRICS + 3
    # with comparison inputs each perf chart has three lines: this run, the previous run, vllm's
    perf_points = [p for p in page.points() if p["data-series"] == "this run"]
    assert len(perf_points) == SHAPES * PERF_METRICS * CONCS
    for other in ("previous run", "vllm"):
        assert sum(p["data-series"] == other for p in page.points()) == SHAPES * PERF_METRICS * CONCS
    prev_tput = [float(p["data-y"]) for p in page.points() if p["data-series"] == "previous run"][:CONCS]
    assert prev_tput == pytest.approx([1.25 * 120.0 * c**0.8 for c in (1, 2, 4, 8, 16)], rel=1e-3)
    assert sorted({float(p["data-x"]) for p in perf_points}) == [1, 2, 4, 8, 16]
    assert page.count("td", "heat") == 6  # the NIAH grid: 2 lengths x 3 depths
    assert html.count('class="badge fail"') >= 2  # the failed throughput gate and the accuracy gate
    assert "(profile perf)" in html and ">driver<" in html


def test_text_from_the_report_is_escaped(tmp_path):
    bad = {**report(), "model": "<script>alert(1)</script>"}
    html = deck.render_html(bad)
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_chart_points_stay_inside_the_plot():
    svg = line_chart([("s", [(1, 0.0), (2, 1102.75), (4, 37.0)])], "t", "x", "y", log2_x=True)
    ys = [float(a["cy"]) for a in parse(svg).points()]
    assert min(ys) >= 30 and max(ys) <= 260 - 44  # the top and bottom margins
    ticks = nice_ticks(0, 1102.75)
    assert ticks[0] <= 0 and ticks[-1] >= 1102.75
    assert "no data" in line_chart([("s", [(1, None)])], "t", "x", "y")


def test_a_report_without_blocks_or_cells_still_renders():
    html = deck.render_html({"cells": {}, "gates": []})
    assert "No sweep cells" in html and "No gates" in html


# --- in a real browser -------------------------------------------------------------------------


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def browser() -> str:
    path = find_browser()
    if path is None:
        pytest.skip(f"no headless browser ({', '.join(BROWSERS)}) on PATH: scripts/setup.sh installs chromium as root")
    return path


def headless(browser: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # --no-sandbox: tests may run as root, where Chromium's sandbox refuses to start
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_the_browser_renders_the_plots(browser, tmp_path):
    prev, parity = write_inputs(tmp_path)
    html_path, _ = deck.write_deck(report(), tmp_path / "deck", prev, parity)
    out = headless(browser, "--dump-dom", html_path.as_uri())
    assert out.returncode == 0, out.stderr[-2000:]
    dom = parse(out.stdout)
    assert dom.count("svg", "chart") == SHAPES * PERF_METRICS + 3
    assert len(dom.points()) >= SHAPES * PERF_METRICS * CONCS
    assert dom.count("polyline") >= SHAPES * PERF_METRICS
    assert "Long-context accuracy" in out.stdout and "Framework parity" in out.stdout

    shot = tmp_path / "deck.png"
    out = headless(browser, f"--screenshot={shot}", "--window-size=1400,2400", html_path.as_uri())
    assert out.returncode == 0 and shot.is_file(), out.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000  # a blank page compresses to a few kB


def test_bench_deck_command(tmp_path):
    from typer.testing import CliRunner

    from atomc.bench.cli import bench_app

    prev, _parity = write_inputs(tmp_path)
    path = tmp_path / "sweep_results.json"
    path.write_text(json.dumps(report()))
    out = CliRunner().invoke(bench_app, ["deck", str(path), "--prev-report", str(prev)])
    assert out.exit_code == 0, out.output
    assert "run deck:" in out.output and (tmp_path / deck.HTML_FILE).is_file()
    assert "prev_run" in json.loads((tmp_path / deck.JSON_FILE).read_text())["panels"]
    out = CliRunner().invoke(bench_app, ["deck", str(path), "--prev-report", str(tmp_path / "nope.json")])
    assert "run deck not written" in out.output and "previous report" in out.output


def test_the_comparison_inputs_are_read_in_env_and_are_no_graph_factor(monkeypatch, tmp_path):
    from atomc import env

    monkeypatch.delenv("CVS_INFERENCE_PREV_REPORT_JSON", raising=False)
    assert env.prev_report_json() is None
    monkeypatch.setenv("CVS_INFERENCE_PREV_REPORT_JSON", str(tmp_path / "p.json"))
    monkeypatch.setenv("CVS_ATOM_PARITY_REF_JSON", "~/ref.json")
    assert env.prev_report_json() == tmp_path / "p.json"
    assert env.parity_ref_json() == Path("~/ref.json").expanduser()
    assert {"CVS_INFERENCE_PREV_REPORT_JSON", "CVS_ATOM_PARITY_REF_JSON"} <= set(env.snapshot())
    assert not {"CVS_INFERENCE_PREV_REPORT_JSON", "CVS_ATOM_PARITY_REF_JSON"} & set(env.graph_snapshot())


def test_errored_tasks_and_skipped_cells_render_with_their_reasons():
    r = report()
    acc, niah = r["blocks"][0], r["blocks"][1]
    acc["rows"].append({"id": "broken", "tasks": ["gsm8k"], "metrics": {}, "gates": [], "status": "ERROR",
                        "error": "lm-eval exited with code 3"})  # fmt: skip
    niah["rows"].append({"id": "128k", "grid": [{"length": 131072, "status": "SKIP", "reason": "too long"}],
                         "pass_rate": None, "status": "SKIP", "reason": "length 131072: too long",
                         "gates": []})  # fmt: skip
    html = deck.render_html(r)
    assert "lm-eval exited with code 3" in html and "length 131072: too long" in html
    assert parse(html).count("td", "heat") == 6  # the skipped cell adds no grid


def test_gated_rows_come_first_and_recorded_ones_fold():
    gates = [{"cell": "c", "metric": f"m{i}", "status": "INFO"} for i in range(30)]
    gates.insert(20, {"cell": "c", "metric": "bad", "status": "FAIL", "reason": "too slow"})
    html = deck.render_html({"cells": {}, "gates": gates})
    details = html.index("<details>")
    assert html.index("too slow") < details  # the failure is above the fold
    assert "30 metrics recorded, not gated" in html and html.index(">m0<") > details


def test_report_paths_are_relative_to_the_run_folder(tmp_path, monkeypatch):
    from atomc.bench.suite import shown_path

    monkeypatch.chdir(tmp_path)
    assert shown_path(tmp_path / "cvs" / "a.json") == "cvs/a.json"
    assert shown_path("/elsewhere/b.json") == "/elsewhere/b.json" and shown_path(None) is None
