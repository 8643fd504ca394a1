"""Holds ``sitecustomize.py``, which runs where this folder is put on PYTHONPATH (``rollout/vllm/vision.py``
``torchvision_free``); a package only so that it ships with megatron_rl."""
