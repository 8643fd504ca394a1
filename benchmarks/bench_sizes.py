"""The two task sizes the trainer benchmarks share (test_vs_trl.py, test_async.py): the demo and a ~30M-parameter
Qwen2-shaped random model with 32-token responses, and the config overrides that give a run those sizes."""
from __future__ import annotations

from pathlib import Path

SIZES = {
    "demo": {"prompts": 32, "n": 8, "response_length": 6, "lr": 5e-3, "model": None},
    "30M": {"prompts": 16, "n": 8, "response_length": 32, "lr": 1e-4,
            "model": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 10,  # 29.5M parameters
                      "num_attention_heads": 8, "num_key_value_heads": 4}},
}


def size_overrides(size: dict) -> list[str]:
    """Batch, group, response length and learning rate of ``size``: two optimizer steps per batch."""
    prompts, n = size["prompts"], size["n"]
    return [f"data.train_batch_size={prompts}", f"actor_rollout_ref.rollout.n={n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts // 2}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={prompts // 2 * n}",
            f"data.max_response_length={size['response_length']}", f"actor_rollout_ref.actor.optim.lr={size['lr']}"]


def model_dir(assets_model: Path, shape: dict | None, out: Path) -> Path:
    """The demo's model, or a random one of ``shape`` (HF config fields) with the demo's tokenizer."""
    if shape is None:
        return assets_model
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(assets_model)
    for key, value in shape.items():
        setattr(config, key, value)
    if getattr(config, "layer_types", None):  # one entry per layer
        config.layer_types = [config.layer_types[0]] * config.num_hidden_layers
    config.max_position_embeddings = 128
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (assets_model / name).exists():
            (out / name).write_bytes((assets_model / name).read_bytes())
    return out
