"""Per-tenant metric labels are bounded and earned: junk tenant names cannot take them."""

from __future__ import annotations

from async_engine.server.tenant_labels import OTHER, TenantLabels


def test_a_tenant_gets_its_label_after_enough_requests():
    labels = TenantLabels(max_labels=4, promote_after=3)
    assert [labels.label("search") for _ in range(4)] == [OTHER, OTHER, "search", "search"]


def test_junk_names_sent_once_each_never_take_a_label():
    labels = TenantLabels(max_labels=4, promote_after=3, max_candidates=100)
    assert {labels.label(f"junk-{i}") for i in range(10_000)} == {OTHER}
    assert not labels.labelled
    assert len(labels._seen) <= 100  # the tally of would-be tenants stays bounded
    for _ in range(3):
        last = labels.label("real")
    assert last == "real"


def test_labels_are_capped_and_the_rest_share_other():
    labels = TenantLabels(max_labels=2, promote_after=1)
    assert [labels.label(t) for t in ("a", "b", "c", "a")] == ["a", "b", OTHER, "a"]


def test_preset_tenants_are_labelled_from_the_start_and_no_tenant_is_default():
    labels = TenantLabels(max_labels=4, promote_after=100, preset=["search"])
    assert labels.label("search") == "search"
    assert TenantLabels(promote_after=1).label("") == "default"
