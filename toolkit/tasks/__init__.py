"""Example tasks: data generators with a fixed seed, used to train small real models."""
