"""Operator tools over the path API: ``fsck``, ``gc``, ``scrub`` and bulk ``transfer``."""

from .fsck import fsck
from .gc import collect
from .scrub import NoAnswer, answered, heal_status
from .transfer import export_tree, import_tree

__all__ = ["NoAnswer", "answered", "collect", "export_tree", "fsck", "heal_status",
           "import_tree"]
