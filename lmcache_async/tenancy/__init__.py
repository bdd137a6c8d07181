"""Tenants: names checked and turned into the tags bound into every key (:mod:`.tenants`),
quotas per tenant and tier (:mod:`.quotas`) and the labels figures show a tenant by
(:mod:`.labels`), both parsed by the configuration.

Part of the ground floor: the configuration reads quotas, and keys, tiers and figures all
know tenants. May import: ``errors`` only.
"""
