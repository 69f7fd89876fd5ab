"""The pipeline benchmark's bookkeeping: repeated runs reduce to per-field medians."""

from __future__ import annotations

import pytest

from pipelines.bench_pipeline import main, median_run, share_equal


def test_median_run_takes_each_numeric_field_median():
    runs = [
        {"scheduler": "dspark", "job_tokens_per_s": 10.0, "output_tokens": 300, "mean_accepted_length": None},
        {"scheduler": "dspark", "job_tokens_per_s": 30.0, "output_tokens": 300, "mean_accepted_length": 1.5},
        {"scheduler": "dspark", "job_tokens_per_s": 12.0, "output_tokens": 300, "mean_accepted_length": 1.7},
    ]
    m = median_run(runs)
    assert m["job_tokens_per_s"] == 12.0  # one noisy repeat does not move it
    assert m["output_tokens"] == 300 and m["scheduler"] == "dspark" and m["repeats"] == 3
    assert m["mean_accepted_length"] == pytest.approx(1.6)  # missing values are skipped


def test_repeats_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["--repeats", "0"])
    assert "--repeats" in capsys.readouterr().err


def test_share_equal_counts_rows_with_the_same_text_by_id():
    ours = {"a": "x", "b": "y", "c": "z", "d": "w"}
    theirs = {"a": "x", "b": "Y", "d": "w", "e": "x"}  # b differs, c is missing
    assert share_equal(ours, theirs) == 0.5
    assert share_equal(ours, dict(ours)) == 1.0
    assert share_equal({"c": "z"}, theirs) == 0.0  # a row they lack counts as different
