"""jobs/bench/with_setting: the lent-GPU scripts' variants set class attributes before a suite runs."""

from eagleray.jobs.bench.with_setting import apply
from eagleray.platform.models.decode_metadata import DecodeMetadata
from eagleray.platform.models.draft_graphs import FusedDraftStep


def test_every_named_attribute_takes_the_literal_and_no_name_sets_nothing(monkeypatch):
    monkeypatch.setattr(FusedDraftStep, "TRITON_PRODUCT_ROWS", 0)
    monkeypatch.setattr(DecodeMetadata, "ONE_TILE_SPLITS", False)
    apply("", "")
    assert FusedDraftStep.TRITON_PRODUCT_ROWS == 0 and DecodeMetadata.ONE_TILE_SPLITS is False
    apply("eagleray.platform.models.draft_graphs:FusedDraftStep.TRITON_PRODUCT_ROWS", "8")
    assert FusedDraftStep.TRITON_PRODUCT_ROWS == 8
    apply(
        "eagleray.platform.models.decode_metadata:DecodeMetadata.ONE_TILE_SPLITS,"
        "eagleray.platform.models.draft_graphs:FusedDraftStep.TRITON_PRODUCT_ROWS",
        "True",
    )
    assert DecodeMetadata.ONE_TILE_SPLITS is True and FusedDraftStep.TRITON_PRODUCT_ROWS is True
