"""The machinery behind ``python -m pytest_gpumem validate``: workloads, checks, the record, its replay.

On a GPU it runs the CUDA suite, reference workloads whose bytes can be counted by hand, the plugin against PyTorch's
counters and the zoo on both engines, and writes a record that CPU-only CI replays (docs/validation.md). ``--cpu-only``
writes the same record with every GPU figure ``None``; a figure not measured is ``None``.
"""
