"""The machinery behind ``python -m pytest_gpumem validate``: workloads, checks, the record, its replay.

``python -m pytest_gpumem validate`` validates pytest-gpumem on a real GPU and records what it saw, so
that CPU-only CI can replay the parts of the plugin that interpret GPU data. On a CUDA
machine it

1. runs the CUDA test suite (``pytest tests -m cuda`` with the plugin loaded from the checkout);
2. runs reference workloads and asserts what PyTorch's allocator must show: a fp32
   ``nn.Linear(256, 250)`` takes 256,000 + 1,024 bytes, its first forward costs its output
   alone (the clean-state protocol made the cuBLAS workspaces before the start: reported)
   and leaves nothing, Adam's first step adds twice the parameter bytes (plus step counters
   that live on the GPU), a bf16 MLP saves 18·b·s·d bytes with GELU and 10·b·s·d with ReLU
   (saved-tensor accounting and allocator bytes), ``measure()`` of a warmed-up step equals
   PyTorch's counters read by hand, the same step twice gives the same figures (``reserved``
   within one allocator segment), and training steps of the zoo add no workspace to those
   the protocol made;
3. checks, for every workload, that the plugin's peak / allocated / reserved equal
   ``max_memory_allocated`` / ``memory_allocated`` / ``max_memory_reserved`` read at the end
   of the same span (peaks reset at its start), to the byte;
4. trains each model of the zoo (:mod:`pytest_gpumem.validate.zoo`) one step on the CPU engine with CUDA
   rounding and on the GPU, and splits each gap into bytes outside tensors (workspaces,
   unsplit blocks) and tensors that differ by category (kernel and algorithm choices);
5. writes the record: ``record.json``, ``summary.md``, ``memory_stats.json`` (raw
   ``memory_stats()`` dumps), ``snapshot.pickle`` (a capped PyTorch memory snapshot) and
   ``cuda-suite.log``, then replays it at once (:func:`replay`) as CI will.

``--cpu-only`` runs what needs no GPU (the CPU half of the zoo, the reference workloads on
the CPU engine) and writes the same record with every GPU figure ``None`` ("n/a"), so the
machinery is tested on any machine. It never writes into ``fixtures/recorded/``: only a real
GPU run may.

Every size is bytes. Nothing here is faked: a figure not measured is ``None``.
"""
