"""Parity with TRL (the optional bench extra): same weights and plain-text preference data give
the same token ids, logits and step-0 DPO metrics in our code and in TRL's DPOTrainer."""

import pytest

pytest.importorskip("trl")
pytest.importorskip("torch")


@pytest.mark.slow
def test_dpo_parity_with_trl():
    from tools.bench import trl_parity

    report = trl_parity.check(echo=lambda *_: None)
    assert report["logits_max_abs_diff"] < 1e-4
    assert report["token_mismatches"] == []
    for name, row in report["metrics"].items():
        assert row["abs_diff"] is not None and row["abs_diff"] < 1e-4, (name, row)
    assert report["ok"]
