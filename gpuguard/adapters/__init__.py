"""Adapters: one third-party library (or kernel interface) each, translated into core types."""
