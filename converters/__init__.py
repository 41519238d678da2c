"""Converters between engine checkpoint formats and the universal checkpoint; and the `interop` CLI."""
