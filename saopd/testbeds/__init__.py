"""Testbeds with a known ground truth: models whose spurious priors are planted by
construction, so a filter's selections can be scored against the truth.

The model wrappers (``planted``: :mod:`saopd.testbeds.planted`; ``tic``:
:mod:`saopd.testbeds.tic`) are declared in :data:`saopd.models.factory.MODEL_WRAPPERS` by
module, and imported only when a model config has their block (``model.planted``,
``model.tic``); ``arithmetic`` is the arithmetic testbed's token ground truth.
"""
