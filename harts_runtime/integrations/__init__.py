"""Adapters that put :class:`harts_runtime.engine.HartsEngine` behind RL frameworks' engine APIs.

=========================================  ===========================================================
module                                     what
=========================================  ===========================================================
:mod:`harts_runtime.integrations.verl`     verl 0.9.1 ``BaseEngine`` registered as backend ``"harts"``
                                           (``model_type="language_model"``, cuda and cpu); needs the
                                           ``verl`` extra
=========================================  ===========================================================

Nothing here is imported by the rest of the runtime; each module imports its framework at import
time, so ``import harts_runtime.integrations`` alone needs none of them.
"""
