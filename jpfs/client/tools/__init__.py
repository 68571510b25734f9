"""Operator tools over the path API: ``fsck``, ``gc``, ``scrub`` and bulk ``transfer``."""
