"""Staged store and retrieve pipelines: stages joined by bounded streams (:mod:`.stage`),
the store and retrieve stages (:mod:`.store`, :mod:`.retrieve`) and layer-by-layer
transfers (:mod:`.layerwise`).

May import: ``core``, ``backends``, the data model and the ground floor. Never ``engine``,
``rpc`` or anything above.
"""
