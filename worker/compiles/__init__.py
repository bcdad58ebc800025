"""Compiles and readiness: warm-up's synthetic steps, the graphs serving needs first, and the rest compiled in
the background."""
