"""Test helpers: an independent float64 oracle and the precision rules of docs/semantics/precision.md."""
