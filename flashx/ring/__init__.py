"""The parts of ring attention, one concept per module; ``flashx.distributed`` is their public
face, and its docstring maps them. Importing a module of this package imports torch."""
