"""`loraplane demo`: the main job on embedded defaults, from a bare machine to a per-adapter report."""
