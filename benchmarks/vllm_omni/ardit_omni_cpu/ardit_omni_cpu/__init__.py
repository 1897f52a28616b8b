"""An out-of-tree CPU platform for vLLM-Omni 0.30.0 (benchmark-only; ardit never imports it).

Kept free of imports: the ``.pth`` hook (``torchvision_ops``) and the entry point (``plugin``) load this package
in every process of the venv, before torch.
"""
