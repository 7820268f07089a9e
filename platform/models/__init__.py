"""platform/models."""
