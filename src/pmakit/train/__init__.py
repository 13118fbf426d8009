"""Our own small trainer for PMA studies on a CPU: data, model, loop.

- ``pmakit.train.data``: a text corpus (the pinned torch package's Python sources by default) -> a locally trained byte-level
  BPE tokenizer + train/val token arrays (split by file, cached); deterministic batches.
- ``pmakit.train.model``: a small ``LlamaForCausalLM`` built from a config (no downloads).
- ``pmakit.train.loop``: the training loop with the WSD schedule, the snapshot saver and the online averager.
- ``pmakit.train.averaging``: the one averaging hook (snapshot saver + online averager + metrics + resume) that
  the loop and every framework adapter in ``pmakit.integrations`` use.
- ``pmakit.train.spike_recovery``: the ``SpikeRecovery`` callback (roll back onto a merge after a loss spike).

Nothing is imported here, so that ``import pmakit.train.data`` stays light and entry points can set up the
environment before torch is imported.
"""
