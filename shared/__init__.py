"""The AR→DiT contract: everything the two services must agree on, written once.

- ``HANDOFF_SPEC.md``: the handoff in prose (normative field list: ``frames.py``).
- ``diffusion``: what the DiT is asked to render (``DiffusionParams``) and the facts the public
  API, the AR and the DiT share about it (seed bound, size pattern, output formats, previews).
- ``capabilities``: what a DiT announces (limits, defaults, capacity) and the one check of a
  request against its limits.
- ``row_recipe``: how rows are read from the text encoder (layers, final norm, template, which rows),
  and the one comparison of two recipes.
- ``frames``, ``frame_types``, ``frame_codec``, ``tensor_codec``, ``checksum``: the frames (and the base
  every wire model shares), their bytes (raw tensor memory, scatter/gather), and their integrity.
- ``handoff_encoder`` (sender), ``handoff_assembler`` (receiver), ``row_buffer_pool``; ``result_frames``:
  the DiT's answer on the same exchange; ``errors``: every typed way a handoff can be wrong.

It imports neither service; both import it. The goldens of the contract are in tests/contract/.
"""
