"""Test helpers: an independent float64 oracle and the precision rules of SEMANTICS.md section 11."""
