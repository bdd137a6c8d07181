"""Processes over ZeroMQ: the wire protocol and the scheduler-to-worker lookup service.

May import: ``engine`` and every layer under it. Never ``sync``, ``integrations``, ``cli``
or ``bench``.
"""

from __future__ import annotations
