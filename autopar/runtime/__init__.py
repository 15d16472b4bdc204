"""Executing plans: process groups, meshes, sharding, pipeline stages, checkpoints."""
