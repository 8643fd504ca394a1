"""Stand-in of ``sglang.srt.utils.patch_torch``: the CUDA-IPC device-index patch has nothing to do on CPU."""


def monkey_patch_torch_reductions() -> None:
    """No-op (SGLang rewrites the device index inside CUDA IPC rebuild args; CPU shared memory has none)."""
    return
