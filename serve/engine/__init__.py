"""serve/engine."""
