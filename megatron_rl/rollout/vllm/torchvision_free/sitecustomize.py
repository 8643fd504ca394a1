"""vLLM 0.32's Qwen2-VL / Qwen2.5-VL code without torchvision (``rollout.name=vllm`` on CPU, where ``make install-vllm``
removes the registry's torchvision: a CUDA build that breaks ``import vllm``).

vLLM imports transformers' torchvision image processor module only for ``smart_resize`` and the processor class
(vllm/model_executor/models/qwen2_vl.py:38,43; that module imports torchvision at its line 26), and loads the
checkpoint's processor with its video processor, which transformers refuses without torchvision. This module,
put first on ``PYTHONPATH`` of the processes vLLM starts (``megatron_rl.rollout.vllm.vision.torchvision_free``) and
run in the engine's own process, makes both imports give transformers' PIL image processor (the one the trainer's
processor uses without torchvision, so both see the same pixels) and a processor of images only. Nothing
changes where torchvision imports. Standard library only until one of those modules is imported; afterwards the
next ``sitecustomize`` on the path, if any, runs as it would have.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PROCESSORS = {"transformers.models.qwen2_5_vl.processing_qwen2_5_vl": "Qwen2_5_VLProcessor",
               "transformers.models.qwen2_vl.processing_qwen2_vl": "Qwen2VLProcessor"}


def _torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


class _ImagesOnly(importlib.abc.Loader):
    """The real processor module, its processor class replaced by one without a video processor."""

    def __init__(self, real: importlib.abc.Loader, class_name: str) -> None:
        self.real, self.class_name = real, class_name

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module) -> None:
        self.real.exec_module(module)
        _images_only(module, self.class_name)


def _images_only(module, class_name: str) -> None:
    """Replace ``module.<class_name>`` (and the package's cached attribute) by its images-only subclass, once."""
    base = getattr(module, class_name)
    if getattr(base, "_mrl_images_only", False):
        return

    # ProcessorMixin takes its sub-processors from __init__'s signature: without video_processor it loads only
    # the image processor and the tokenizer
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        base.__init__(self, image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                      chat_template=chat_template, **kwargs)
        from transformers.processing_utils import VideosKwargs

        # vLLM reads the video processor's kwargs names when it lists the processor's options
        self.video_processor = _NoVideos(VideosKwargs)

    images_only = type(class_name, (base,), {"__init__": __init__, "__module__": module.__name__,
                                              "_mrl_images_only": True})
    setattr(module, class_name, images_only)
    package = sys.modules.get(module.__name__.rpartition(".")[0])
    if package is not None and class_name in vars(package):  # transformers' lazy package caches what it handed out
        setattr(package, class_name, images_only)


class _NoVideos:
    def __init__(self, kwargs_type) -> None:
        self.valid_kwargs = kwargs_type

    def __call__(self, *args, **kwargs):
        raise ValueError("this vLLM engine runs without torchvision: images only, no videos")


class _PilImageModule(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

        module.smart_resize = pil.smart_resize
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
        module.Qwen2VLImageProcessorKwargs = pil.Qwen2VLImageProcessorKwargs


class TorchvisionFreeFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == _IMAGE_MODULE:
            return importlib.util.spec_from_loader(name, _PilImageModule())
        if name in _PROCESSORS:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _ImagesOnly(spec.loader, _PROCESSORS[name])
            return spec
        return None


def install() -> bool:
    """Put the finder first on ``sys.meta_path`` (once); False where torchvision imports (nothing to do)."""
    if not _torchvision_missing():
        return False
    if not any(type(f).__name__ == "TorchvisionFreeFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, TorchvisionFreeFinder())
    for name, class_name in _PROCESSORS.items():  # imported before (the data side's processor, in this process)
        if name in sys.modules:
            _images_only(sys.modules[name], class_name)
    return True


def _run_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    install()
    _run_next_sitecustomize()
