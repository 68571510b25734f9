"""Per-service method tables (argument types, retry safety) shared by servers and clients."""
