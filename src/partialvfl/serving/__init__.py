"""The prediction service at the label holder (``partialvfl serve``): an HTTP JSON API over a saved model that
predicts from whichever parties answer within a request's deadline.  Above ``methods`` (it calls the methods'
any-subset prediction), beside ``bench``, below ``cli``.

* :mod:`.predictors`: one batch in process (``--table``); :mod:`.federated`: across a federation (``--federation``);
* :mod:`.batcher`: micro-batching of concurrent requests on one batch thread;
* :mod:`.app`: the FastAPI application; :mod:`.metrics`: its Prometheus metrics.
"""
