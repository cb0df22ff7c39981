"""Command-line tools: ``kvxfer-bench`` (``bw``, ``lat``, ``topo``), built on the public API and ``kvxfer.wire``.

Modules: ``bench`` (the command), ``topo`` (the placement table), ``_cases`` (case grammar and
data check), ``_channel`` (control messages), ``_target`` (the target loop),
``_target_process`` (the target as a child), ``_initiator`` (writes and timing),
``_results`` (what a case measured), ``_memmove`` (the baseline), ``_machine`` (report header).
"""
