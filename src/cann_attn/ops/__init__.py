"""One module per operator: validate the documented constraints, build the canonical problem, dispatch."""
