"""Storage tiers: host RAM (:mod:`.cpu`), local disk (:mod:`.disk`), Redis/Valkey
(:mod:`.redis`), and the storage manager over them (:mod:`.manager`): write-through, prefix
lookup across tiers, promotion, pins, freeze, erasure, quotas per tenant.

May import: the ground floor and the data model (``keys``, ``layouts``, ``memory``,
``transfer``). Never ``core``, ``pipelines``, ``engine`` or anything above.
"""
