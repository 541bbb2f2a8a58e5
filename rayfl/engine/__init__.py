"""The engine: the one round loop, the one training loop, executors, workers and the server actor."""
