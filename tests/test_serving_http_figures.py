"""guidellm's runs drawn beside our harness's (ui/figures_serving_http.py): every point of each
run in its loop, the right source and host on each line, the harness's static and single ways
left out; torch-free, as every figure builder is."""

from __future__ import annotations

from ui.figures_serving_http import http_figure, http_points


def _run(kind: str, server: str | None, points: list[dict], device: str = "a CPU") -> dict:
    return {"kind": kind, "run_id": f"{kind}{server}", "meta": {
        "server": server, "device_name": device, "threads": 2}, "tables": {"points": points}}


RUNS = [
    _run("serving_http", "kvlab", [
        {"concurrency": 1, "output_tok_s": 10.0, "ttft_p50_ms": 5.0},
        {"concurrency": 4, "output_tok_s": 30.0, "ttft_p50_ms": 9.0},
        {"rate_per_s": 2.0, "output_tok_s": 20.0, "ttft_p50_ms": 7.0}]),
    _run("serving_http", "llama-server", [
        {"concurrency": 1, "output_tok_s": 12.0, "ttft_p50_ms": 4.0}], device="another CPU"),
    _run("serving", None, [
        {"concurrency": 1, "output_tok_s": 11.0, "ttft_p50_ms": 4.5},
        {"rate_per_s": 2.0, "way": "static", "output_tok_s": 8.0},
        {"rate_per_s": 2.0, "way": "continuous", "output_tok_s": 19.0}]),
    {"kind": "latency_sweep", "meta": {}, "tables": {"points": [{"concurrency": 1}]}},
]


def test_every_point_lands_in_its_loop_with_its_source_and_host() -> None:
    pts = http_points(RUNS)
    assert len(pts) == 6  # the harness's static way and the other kind's run left out
    closed = pts[pts["loop"] == "closed"]
    assert sorted(closed["source"]) == ["llama-server over HTTP", "our harness",
                                        "ours over HTTP", "ours over HTTP"]
    poisson = pts[pts["loop"] == "poisson"].set_index("source")["output_tok_s"]
    assert poisson.to_dict() == {"ours over HTTP": 20.0, "our harness": 19.0}
    fig = http_figure(pts, "output_tok_s", "output tokens/s (measured)")
    names = [t.name for t in fig.data]
    assert len(names) == 3 and all("CPU" in n for n in names)
    ours = next(t for t in fig.data if t.name.startswith("ours"))
    assert list(ours.x) == [1.0, 4.0] and list(ours.y) == [10.0, 30.0]
    assert "another CPU" in next(n for n in names if n.startswith("llama"))


def test_no_run_draws_an_empty_figure() -> None:
    fig = http_figure(http_points([]), "ttft_p50_ms", "TTFT p50 (ms, measured)", "poisson")
    assert len(fig.data) == 0
