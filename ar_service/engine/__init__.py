"""The AR engine: vLLM with hidden-state capture, and everything that crosses its process boundary.

vLLM runs the model in another process (API process → EngineCore, which runs the model itself at
one device; a multi-device engine has worker processes under it). Of this package, ``connector``
and ``final_norm`` run INSIDE vLLM's processes (loaded by vLLM from ``kv_transfer_config``);
``row_channel`` is the ZMQ channel between the model's process and the AR's API process
(``RowSender`` beside the model, ``RowChannel`` in the API process); ``hidden_state_engine`` wraps
``AsyncLLM`` in the API process and turns its outputs and the rows into one event stream.
Nothing else in ``ar_service`` touches vLLM.
"""
