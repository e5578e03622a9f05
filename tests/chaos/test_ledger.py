"""The chaos ledger's classification and table (pure)."""

from __future__ import annotations

from tests.chaos.ledger import (
    CLEAN_ERROR,
    EXACT,
    LOST,
    Ledger,
    RequestRecord,
    classify,
    percentile,
    render_table,
)

EXPECTED = [5, 6, 7, 8]


def test_classify_exact_clean_and_lost():
    assert classify(EXPECTED, EXPECTED, finished=True)[0] == EXACT
    assert classify(EXPECTED, [5, 6, 7, 9], finished=True)[0] == LOST, "a wrong token"
    assert classify(EXPECTED, [5, 6, 7], finished=True)[0] == LOST, "a missing token"
    assert (
        classify(EXPECTED, [5, 6], finished=False, error_code="UNAVAILABLE", error_message="no pool")[0]
        == CLEAN_ERROR
    )
    assert classify(EXPECTED, [5, 7], finished=False, error_code="UNAVAILABLE", error_message="x")[0] == LOST
    assert (
        classify(EXPECTED, [], finished=False, error_code="DEADLINE_EXCEEDED", error_message="late")[0]
        == LOST
    )
    assert classify(EXPECTED, [], finished=False, error_code="UNAVAILABLE", error_message="")[0] == LOST


def test_percentile_nearest_rank():
    assert percentile([], 99) is None
    assert percentile(range(1, 101), 99) == 99
    assert percentile([3.0], 99) == 3.0


def test_rows_and_table():
    ledger = Ledger()
    ledger.begin("quiet")
    ledger.begin("kill pool")
    for i in range(10):
        ledger.add(RequestRecord(0, "quiet", 0.0, 0.1 + i / 100, EXACT, 4))
    ledger.add(RequestRecord(0, "kill pool", 1.0, 0.5, EXACT, 4, migrations=1))
    ledger.add(RequestRecord(1, "kill pool", 1.0, 0.2, CLEAN_ERROR, 2, detail="UNAVAILABLE: x"))
    quiet, fault = ledger.rows()
    assert (quiet.requests, quiet.exact, quiet.lost) == (10, 10, 0)
    assert (fault.requests, fault.exact, fault.clean_errors, fault.migrations) == (2, 1, 1, 1)
    assert fault.p99_ratio is not None and round(fault.p99_ratio, 2) == round(0.5 / 0.19, 2)
    table = render_table([quiet, fault])
    assert "| kill pool | 2 | 1 | 1 | 0 |" in table and ledger.lost == 0


def test_report_is_written_with_errors_and_fail_over_causes(tmp_path):
    from tests.chaos.run import write_report

    ledger = Ledger()
    ledger.begin("quiet")
    ledger.add(
        RequestRecord(0, "quiet", 0.0, 0.1, EXACT, 4, failovers=1, detail="fail-over after a:1: UNAVAILABLE")
    )
    ledger.add(RequestRecord(1, "quiet", 0.0, 0.1, CLEAN_ERROR, 0, detail="UNAVAILABLE: no pool"))
    out = tmp_path / "CHAOS.md"
    write_report(out, ledger, 12.0, 2, "make chaos")
    text = out.read_text()
    assert (
        "| quiet | 2 | 1 | 1 | 0 |" in text and "UNAVAILABLE: no pool" in text and "fail-over after" in text
    )
    ledger.dump(tmp_path / "ledger.jsonl")
    assert len((tmp_path / "ledger.jsonl").read_text().splitlines()) == 2
