"""Processes over ZeroMQ: the wire protocol and the scheduler-to-worker lookup service."""

from __future__ import annotations
