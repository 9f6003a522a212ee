"""The compiler: the ``poros`` backend, the schedule the passes fill, the custom ops that make host
weights traceable, per-block compiled regions, and the dumps (graphs, schedule table, timeline)."""
