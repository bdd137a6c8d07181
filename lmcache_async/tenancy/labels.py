"""Tenant labels: how figures show a tenant (config ``tenant_labels``).

A tenant's name is a secret (vLLM's ``cache_salt``), so statistics, Prometheus series,
admin output and logs never carry it. They show a tenant by the label its operator gave it,
and a tenant without one by its tag's hex (:func:`~.tenants.tag_hex`); the unnamed tenant
is :data:`~.tenants.NONE_LABEL`. Labels are given as a mapping of name to label (YAML)::

    tenant_labels:
      "<cache_salt of team A>": team-a

or, in an environment variable, as that mapping written in YAML or JSON
(``{"<salt>": team-a}``). A label is 1 to :data:`MAX_LABEL_CHARS` printable characters, no
two tenants share one, and none reads like another tenant's figures (a tag's hex form,
``(none)``, ``(other)``, ``other``). Every bad entry raises
:class:`~lmcache_async.errors.ConfigError` naming the label, never the name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

import yaml

from lmcache_async.errors import ConfigError, InvalidInputError
from lmcache_async.tenancy.tenants import NONE_LABEL, TAG_BYTES, check_tenant, tag_hex, tenant_tag

__all__ = ["MAX_LABEL_CHARS", "TenantLabels"]

MAX_LABEL_CHARS: Final = 64
"""Longest label, in characters (a label is a Prometheus label value on every series)."""

_FIELD: Final = "tenant_labels"
_RESERVED: Final = frozenset({NONE_LABEL, "(other)", "other"})
"""Labels the figures use for tenants summed together or unnamed."""
_TAG_TEXT: Final = re.compile(f"[0-9a-fA-F]{{{2 * TAG_BYTES}}}")


@dataclass(frozen=True, slots=True)
class TenantLabels:
    """The operator's label of each tenant it named; build with :meth:`parse`.

    ``by_tag`` maps a tenant's tag to its label; ``names`` is the configured mapping of
    name to label (for :meth:`to_dict` only: it holds the secrets).
    """

    by_tag: Mapping[bytes, str]
    names: Mapping[str, str]

    @classmethod
    def parse(cls, value: object) -> TenantLabels:
        """Labels from a mapping ``{name: label}``, that mapping as YAML/JSON text, or a
        :class:`TenantLabels` (returned as is).

        Raises:
            ConfigError: not a mapping, a name that is not a valid tenant name, a label that
                is not a non-empty printable str of at most :data:`MAX_LABEL_CHARS`
                characters, a reserved label or one that reads like a tag, or one label
                given to two tenants.
        """
        if isinstance(value, TenantLabels):
            return value
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value) if value.strip() else {}
            except yaml.YAMLError:
                raise ConfigError(_FIELD, "expected a mapping of name to label") from None
        if not isinstance(value, Mapping):
            raise ConfigError(
                _FIELD, f"expected a mapping of tenant name to label, got {type(value).__name__}"
            )
        by_tag: dict[bytes, str] = {}
        names: dict[str, str] = {}
        for name, label in value.items():
            _check_label(label)
            try:
                if not isinstance(name, str):
                    raise InvalidInputError("not a str")
                tag = tenant_tag(check_tenant(name))
            except InvalidInputError:
                raise ConfigError(
                    f"{_FIELD}.{label}", "the tenant of this label is not a valid tenant name"
                ) from None
            if label in names.values():
                raise ConfigError(f"{_FIELD}.{label}", "this label is given to two tenants")
            by_tag[tag] = names[name] = label
        return cls(MappingProxyType(by_tag), MappingProxyType(names))

    def label(self, tag: bytes) -> str:
        """How figures show the tenant with ``tag``: its label, else the tag's hex, and
        :data:`~.tenants.NONE_LABEL` for the unnamed tenant."""
        label = self.by_tag.get(tag)
        if label is not None:
            return label
        return NONE_LABEL if tag == _NONE_TAG else tag_hex(tag)

    def to_dict(self) -> dict[str, str]:
        """The mapping form; :meth:`parse` reads it back."""
        return dict(self.names)


_NONE_TAG: Final = tenant_tag(None)


def _check_label(label: object) -> None:
    if not isinstance(label, str) or not label:
        raise ConfigError(_FIELD, f"a label must be a non-empty str, got {type(label).__name__}")
    if len(label) > MAX_LABEL_CHARS or not label.isprintable():
        raise ConfigError(
            _FIELD, f"a label is 1 to {MAX_LABEL_CHARS} printable characters, got {label!r:.80}"
        )
    if label in _RESERVED or _TAG_TEXT.fullmatch(label):
        raise ConfigError(f"{_FIELD}.{label}", "this label reads like another tenant's figures")
