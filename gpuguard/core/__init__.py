"""Pure core: model types and decisions. Standard library only; no I/O, clock or logging."""
