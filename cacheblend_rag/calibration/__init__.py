"""Calibration, a product feature: ``cacheblend-rag calibrate`` measures candidate blend settings for a model and
saves the cheapest that keeps its answers close to full prefill; the engine reads the saved setting back.

- :mod:`~cacheblend_rag.calibration.lookup`: the saved settings, read by the engine and both integrations (imports
  neither the engine nor the measuring side, so everything can import it);
- :mod:`~cacheblend_rag.calibration.measure`: the measurements and the saving (runs the benchmark harness's requests);
- :mod:`~cacheblend_rag.calibration.bound`: the work bound of a setting on a model's shapes, the cost ``--cost work`` ranks by;
- :mod:`~cacheblend_rag.calibration.choice`: what a calibration asks of a setting, and the choice;
- :mod:`~cacheblend_rag.calibration.state`: the resumable state file of one calibration;
- :mod:`~cacheblend_rag.calibration.commands`: the ``cacheblend-rag calibrate`` command.

Nothing is imported here, so the engine's import of ``lookup`` pulls in none of the measuring side.
"""
