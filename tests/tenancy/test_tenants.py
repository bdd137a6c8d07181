"""Tenant tags and labels: a tag is 16 bytes of the name alone; figures show a tenant by
its operator's label, else by its tag's hex, and no error message repeats a name."""

from __future__ import annotations

import pytest

from lmcache_async.errors import ConfigError, InvalidInputError
from lmcache_async.tenancy.labels import TenantLabels
from lmcache_async.tenancy.tenants import TAG_BYTES, check_tenant, tag_hex, tag_of, tenant_tag

SECRET = "cache-salt-0c5e1d"


def test_a_tag_is_16_bytes_of_the_name_and_the_start_of_its_keys() -> None:
    tag = tenant_tag(SECRET)
    assert len(tag) == TAG_BYTES == 16 and len(tag_hex(tag)) == 32
    assert tag == tenant_tag(SECRET) != tenant_tag(SECRET + "x") != tenant_tag(None)
    assert tag_of(tag + bytes(16)) == tag


@pytest.mark.parametrize("bad", [SECRET * 20, SECRET + "\ud800"])
def test_a_bad_name_is_refused_without_repeating_it(bad: str) -> None:
    with pytest.raises(InvalidInputError, match="cache_salt") as info:
        check_tenant(bad, field="cache_salt")
    assert SECRET not in str(info.value)


def test_labels_show_a_tenant_by_label_else_by_tag() -> None:
    labels = TenantLabels.parse({SECRET: "team-a"})
    assert labels.label(tenant_tag(SECRET)) == "team-a"
    assert labels.label(tenant_tag("other")) == tenant_tag("other").hex()
    assert labels.label(tenant_tag(None)) == "(none)"
    assert TenantLabels.parse(labels) is labels
    assert TenantLabels.parse("") == TenantLabels.parse({})
    assert labels.to_dict() == {SECRET: "team-a"}
    with pytest.raises(ConfigError, match="two tenants") as info:
        TenantLabels.parse({SECRET: "x", "b": "x"})
    assert SECRET not in str(info.value)
