"""benchmarks/spec_bench_report.py: a category's row and the overall row from repeats' runs (the
paired speed-up's median and range, the speculation counters), and the table that shows
them, without running the engine."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import spec_bench_report  # noqa: E402

from quickdraft.engine.outputs import Usage  # noqa: E402


def _run(tok_s: float, spec_steps: int = 0, accepted: int = 0) -> dict:
    """One repeat's run of a category: 100 tokens from one request in 100 / tok_s seconds."""
    wall = 100 / tok_s
    usage = Usage(prompt_tokens=10, completion_tokens=100, decode_time=wall * 0.9,
                  num_spec_steps=spec_steps, num_drafted_tokens=2 * spec_steps,
                  num_accepted_tokens=accepted)
    return {"tok_s": tok_s, "decode_tok_s": 99 / (wall * 0.9), "decode_tokens": 99,
            "decode_s": wall * 0.9, "latency_s": [wall], "wall_s": wall, "generated": 100,
            "tokens": [list(range(100))], "usage": [usage], "proposer_s": 0.01,
            "guard_off_steps": 0}


def test_rows_carry_the_paired_median_and_range_into_the_table() -> None:
    off = [_run(100.0), _run(100.0), _run(80.0)]
    on = [_run(90.0, 20, 30), _run(120.0, 20, 30), _run(100.0, 20, 30)]  # 0.9, 1.2, 1.25
    row = spec_bench_report.method_row("chat", 8, "suffix", off, on)
    assert row["speedup"] == 1.2
    assert (row["paired_speedup"]["min"], row["paired_speedup"]["max"]) == (0.9, 1.25)
    assert row["spec"]["tokens_per_verify_step"] == 2.5  # (30 + 20) / 20 over 3 repeats
    assert row["agreement"]["identical"] == 1
    overall = spec_bench_report.overall_row([row], 8, "suffix")
    assert overall["paired_speedup"]["values"] == row["paired_speedup"]["values"]
    lines = spec_bench_report.table([row, overall]).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[header.index("speed-up")] == "1.2"
    assert cells[header.index("repeats' range")] == "0.90–1.25"
    assert lines[3].startswith("| overall")
