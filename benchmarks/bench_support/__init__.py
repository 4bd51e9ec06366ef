"""What only the benchmark scripts of this folder (and the tests that hold the engine to their measures) use; not
part of the installed package. Scripts import it as ``bench_support.<module>`` (python puts a script's folder
first on ``sys.path``); pytest puts this folder's parent there (pyproject's ``pythonpath``).

- :mod:`peers`: other stacks' ways of reusing chunk KV (``bench_peers.py``);
- :mod:`host_syncs`: counts host-device synchronisations at their call sites (``bench_decode.py``, ``bench_dispatch.py``);
- :mod:`bandwidth`: how fast the store's loader reads chunk KV cold, beside the disk under it (``bench_engine_scale.py``);
- :mod:`conversation`: what a turn of a conversation should cost (``chat_newcomer.py``, ``bench_chat.py``).
"""
