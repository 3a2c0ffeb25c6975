"""Weight sync from the learner to the inference servers (see docs/weight_sync.md).

Import the parts from their modules: ``sender`` (learner), ``server`` and ``receiver``
(inference server; ``receiver`` imports vLLM), ``buckets``, ``group``, ``control``.
"""
