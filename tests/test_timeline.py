"""The timeline on synthetic logs with known timings: every item is issued at once, and each stage
takes a fixed time per item, so the period, held and wait of every stage are known exactly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kernjax.serve.timeline import gantt, parse, png, report

T0 = 1_760_000_000_000_000  # a wall-clock time in µs


def _log(ms_per_stage: list[float], n: int, *, noise: bool = False) -> list[str]:
    """Lines of a pipeline of stages taking `ms_per_stage` per item, `n` items all issued at T0,
    each stage starting an item once it and its upstream are free; stages' lines interleaved."""
    done = [[0] * n for _ in ms_per_stage]
    out = []
    for k in range(n):
        for s, ms in enumerate(ms_per_stage):
            start = max(T0, done[s][k - 1] if k else T0, done[s - 1][k] if s else T0)
            done[s][k] = start + int(ms * 1000)
            prefix = f"I1008 12:00:00.000000 {100 + s} stage.py:42] "
            out.append(f"{prefix}pp item stage={s} item={k} rows=512 issued_us={T0} "
                       f"done_us={done[s][k]}")
            if noise:
                out += [f"{prefix}compiled stage {s} in 1.2 s", "pp item stage=x item=1",
                        "unrelated line"]
    return out


def _table(text: str) -> dict[str, list[str]]:
    """Report rows by stage, each as its fields after the stage number."""
    rows = text.splitlines()[2:]
    return {r.split()[0]: r.split()[1:] for r in rows}


def test_two_stages_the_faster_downstream_waits():
    t = _table(report(parse(_log([10, 5], 20))))
    # items, period p50 p90, held p50 p90, wait p50 p90, wait share, idle share
    assert t["0"] == ["19", "10.000", "10.000", "10.000", "10.000", "0.000", "0.000", "0.0%", "0.0%"]
    assert t["1"] == ["19", "10.000", "10.000", "5.000", "5.000", "5.000", "5.000", "50.0%", "0.0%"]


def test_three_stages():
    t = _table(report(parse(_log([10, 5, 8], 12))))
    assert t["0"][1:-1] == ["10.000", "10.000", "10.000", "10.000", "0.000", "0.000", "0.0%"]
    assert t["1"][1:-1] == ["10.000", "10.000", "5.000", "5.000", "5.000", "5.000", "50.0%"]
    assert t["2"][1:-1] == ["10.000", "10.000", "8.000", "8.000", "2.000", "2.000", "20.0%"]


def test_first_and_last_choose_the_items():
    t = _table(report(parse(_log([10, 5], 20)), first=5, last=9))
    assert t["1"][0] == "5"


def test_percentiles_over_varying_periods():
    # One stage, item k issued at T0 + k² ms and taking 1 ms: periods 1, 3, 5, ... 19 ms (p50 10,
    # p90 17.2 by linear interpolation). Between items nothing is in flight: the gaps (period - 1)
    # are idle, not pipeline wait.
    lines = [f"pp item stage=0 item={k} rows=1 issued_us={T0 + k * k * 1000} "
             f"done_us={T0 + k * k * 1000 + 1000}" for k in range(11)]
    t = _table(report(parse(lines)))
    assert t["0"] == ["10", "10.000", "17.200", "1.000", "1.000", "0.000", "0.000", "0.0%", "90.0%"]


def _bursts(ms_per_stage: list[float], bursts: int, size: int, gap_ms: float) -> list[str]:
    """`bursts` bursts of `size` items, every item of a burst issued at once, `gap_ms` after the
    previous burst has left the pipeline."""
    lines, t = [], T0
    for b in range(bursts):
        done = [[0] * size for _ in ms_per_stage]
        for j in range(size):
            for s, ms in enumerate(ms_per_stage):
                start = max(t, done[s][j - 1] if j else t, done[s - 1][j] if s else t)
                done[s][j] = start + int(ms * 1000)
                lines.append(f"2026-11-30T09:29:07.002Z pp item stage={s} item={b * size + j} "
                             f"rows=8 issued_us={t} done_us={done[s][j]}")
        t = done[-1][-1] + int(gap_ms * 1000)
    return lines


def test_idle_time_is_not_pipeline_wait():
    # Stages of 10 and 5 ms; bursts of 4 items, each issued 100 ms after the last left stage 1.
    # In a burst stage 1 waits 5 ms per item for stage 0 (pipeline wait). Between bursts nothing
    # is in flight for 100 ms (idle): stage 0's gap of 105 ms is 5 ms wait (stage 1 finishing)
    # and 100 ms idle, stage 1's of 110 ms is 100 ms idle and 10 ms wait (stage 0's first item).
    # Items 1..19: 4 first-of-burst items (period 115 ms) and 15 others (10 ms): 610 ms.
    t = _table(report(parse(_bursts([10, 5], 5, 4, 100))))
    assert t["0"] == ["19", "10.000", "115.000", "10.000", "10.000", "0.000", "5.000",
                      f"{100 * 4 * 5 / 610:.1f}%", f"{100 * 4 * 100 / 610:.1f}%"]
    assert t["1"] == ["19", "10.000", "115.000", "5.000", "5.000", "5.000", "10.000",
                      f"{100 * (15 * 5 + 4 * 10) / 610:.1f}%", f"{100 * 4 * 100 / 610:.1f}%"]


def test_timestamped_lines_parse_like_bare_ones():
    bare = _log([10, 5], 6)
    stamped = [f"2026-11-30T09:29:07.002Z {ln.split('] ', 1)[1]}" for ln in bare]
    assert parse(stamped) == parse(bare)


def test_an_item_done_before_it_was_issued_is_refused():
    with pytest.raises(ValueError, match="stage 1 item 4: done_us 90 precedes issued_us 100"):
        parse(["pp item stage=1 item=4 rows=8 issued_us=100 done_us=90"])


def test_other_lines_are_ignored():
    assert parse(_log([10, 5, 8], 6, noise=True)) == parse(_log([10, 5, 8], 6))


def test_gantt_has_a_row_per_stage_of_width_columns():
    lines = gantt(parse(_log([10, 5, 8], 30)), width=50, max_items=10).splitlines()
    rows = [ln.split("|")[1] for ln in lines if ln.startswith("stage")]
    assert len(rows) == 3 and all(len(r) == 50 for r in rows)
    assert set("".join(rows)) == set(".0123456789")
    assert rows[0].startswith("0") and rows[2].startswith(".")


def test_gantt_draws_first_to_last():
    items = parse(_log([10, 5], 30))
    assert gantt(items, first=5, last=12, width=40).splitlines()[0].startswith("items 5..12 ")
    assert gantt(items, first=3, width=40).splitlines()[0].startswith("items 3..22 ")
    with pytest.raises(ValueError, match="no item in 40..50"):
        gantt(items, first=40, last=50)


def test_png_is_written(tmp_path):
    path = png(parse(_log([10, 5], 8)), tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_pp_item_lines():
    with pytest.raises(ValueError, match="no `pp item"):
        parse(["hello", "pp item stage=0"])


def test_no_item_on_every_stage():
    lines = _log([10], 3) + [f"pp item stage=1 item={k} rows=1 issued_us=0 done_us=1"
                             for k in (5, 6)]
    with pytest.raises(ValueError, match="no item is on every stage.*stage 1 logs items 5..6"):
        report(parse(lines))


def test_an_item_twice():
    with pytest.raises(ValueError, match="stage 0 logs item 0 twice"):
        parse(_log([10], 3) * 2)


def test_command_line(tmp_path):
    logs = [tmp_path / "stage0.log", tmp_path / "stage1.log"]
    for s, log in enumerate(logs):  # one log per stage process
        log.write_text("\n".join(ln for ln in _log([10, 5], 8, noise=True) if f"stage={s} " in ln))
    cmd = [sys.executable, "-m", "kernjax", "timeline", *map(str, logs), "--width", "40",
           "--png", str(tmp_path / "t.png")]
    ok = subprocess.run(cmd, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert _table(ok.stdout.split("\n\n")[0])["1"][-2] == "50.0%"
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    some = subprocess.run(cmd[:5] + ["--first", "2", "--last", "4"], capture_output=True, text=True)
    assert "items 2..4, times in ms" in some.stdout and "items 2..4 over" in some.stdout
    bad = subprocess.run(cmd[:3] + [str(tmp_path / "none.log")], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr



def test_lines_that_mention_pp_item_and_do_not_parse_are_said(capsys):
    """Skipped, not counted, and said once; digits other than ASCII's are not numbers here."""
    good = _log([10], 3)
    got = parse(good + ["pp item stage=0 item=9 rows=1", "pp item stage=0 item=٣ rows=1 "
                        "issued_us=1 done_us=2"])
    assert got == parse(good)
    err = capsys.readouterr().err
    assert "note: 2 line(s) mention `pp item` but do not parse, skipped" in err, err


def test_command_line_bounds(tmp_path):
    log = tmp_path / "stage0.log"
    log.write_text("\n".join(_log([10], 8)))
    cmd = [sys.executable, "-m", "kernjax", "timeline", str(log)]
    for extra, words in ((["--first", "5", "--last", "2"], "--last 2 is before --first 5"),
                         (["--first", "-1"], "flag --first=-1: -1 is not"),
                         (["--width", "100000000"], "flag --width=100000000")):
        p = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr
