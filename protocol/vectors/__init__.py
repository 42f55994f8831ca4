"""Golden vectors of protocol v1: NAME.frame (exact framed bytes) + NAME.json (what they mean).

Written only by `python -m protocol.vectors.generate`; a test regenerates them in memory and
checks the files match. SPEC.md §11 describes the JSON format.
"""
