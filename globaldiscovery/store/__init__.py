"""Where the directory lives: the Store interface and its implementations (in memory by default)."""

from __future__ import annotations

from globaldiscovery.store.base import Store, StoreIsolated, StoreUnavailable
from globaldiscovery.store.memory import MemoryStore

__all__ = ["MemoryStore", "Store", "StoreIsolated", "StoreUnavailable"]
