"""The documented operator parameters turned into one canonical description (docs/design.md, "Layers").

Each semantic rule lives in exactly one module here: layouts, actual lengths, masks, pse, dropout and
softmax statistics. Backends consume the canonical form and never look at the raw arguments.
"""
