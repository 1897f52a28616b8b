"""The AR engine: vLLM with hidden-state capture, and everything that crosses its process boundary.

vLLM runs the model in other processes (API process → EngineCore → worker). Of this package,
``connector`` and ``final_norm`` run INSIDE vLLM's processes (loaded by vLLM from
``kv_transfer_config``); ``row_channel`` is the ZMQ channel between the worker and the AR's API
process (``RowSender`` in the worker, ``RowChannel`` in the API process); ``hidden_state_engine``
wraps ``AsyncLLM`` in the API process and turns its outputs and the rows into one event stream.
Nothing else in ``ar_service`` touches vLLM.
"""
