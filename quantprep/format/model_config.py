"""Bounds on what an artifact's config.json may say, wherever a runtime builds from it."""

MAX_SIZE = 1 << 20  # any one dimension of a config: far above real models, small enough that no array of it exhausts memory
