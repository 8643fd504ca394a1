"""Megatron-Core's GPTModel with multi-token-prediction layers (models/mtp.py) that run only where a training step asks
for their loss.

Megatron-Core 0.16.1's GPTModel runs its MTP block in every forward and needs ``labels`` whenever it has one (its
``_postprocess`` clones them). The trainer's forwards take logits, never labels (the log-probs are gathered by our
own kernels), and only the actor's update wants the MTP loss. ``MTPGPTModel`` keeps Megatron's MTP block (its
layers, the embedding copy on the last pipeline stage and the tied gradients) and replaces the postprocess:
* no targets set (log-probs, the reference, validation): the logits of the main head, as GPTModel without MTP;
* ``mtp_targets`` set (``MTPTargets.of``, per micro-batch, by the engine): the MTP block runs on the decoder's output,
  each depth's logits come from the shared output layer, and its cross-entropy at the targeted positions joins the
  backward pass through Megatron's ``MTPLossAutoScaler`` (as GPTModel does), weighted
  ``mtp_loss_scaling_factor / depths`` and averaged per micro-batch, over micro-batches and DP ranks (Megatron's
  normalisation, which verl's MTP training keeps).
``detach_encoder`` (verl's key): the MTP layers see the main model's output, the embeddings and the output layer's
weight detached, so their loss trains the MTP layers only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler


@dataclass
class MTPTargets:
    """One micro-batch's MTP targets: per depth k (1..D), [b, s] labels and a float mask over the positions whose
    token k + 1 ahead is a response token (the layout of the model's input ids, padded or THD)."""

    labels: list[torch.Tensor]
    masks: list[torch.Tensor]
    scale: float  # mtp_loss_scaling_factor / D / (micro-batches x DP ranks)
    detach_encoder: bool

    @classmethod
    def of(
        cls, shape: tuple[int, int], rows: torch.Tensor, predictors: torch.Tensor, labels: torch.Tensor,
        starts: torch.Tensor, depths: int, scale: float, detach_encoder: bool,
    ) -> MTPTargets:
        """Targets of response tokens ``labels`` [N] at row ``rows`` [N], predicted by the main head at position
        ``predictors`` [N]; depth k predicts each from ``predictors - k``, if that is not before its sequence's
        first position ``starts`` [N]."""
        all_labels, masks = [], []
        for k in range(1, depths + 1):
            at = predictors - k
            keep = at >= starts
            target = torch.zeros(shape, dtype=torch.long, device=labels.device)
            mask = torch.zeros(shape, dtype=torch.float32, device=labels.device)
            target[rows[keep], at[keep]] = labels[keep]
            mask[rows[keep], at[keep]] = 1.0
            all_labels.append(target)
            masks.append(mask)
        return cls(all_labels, masks, scale, detach_encoder)


class MTPGPTModel(GPTModel):
    """GPTModel whose MTP block runs only under ``mtp_targets`` (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mtp_targets: MTPTargets | None = None
        # per depth: sum of the masked cross-entropy and the token count since the last ``take_mtp_losses``
        depths = self.config.mtp_num_layers or 0
        self._loss_sums = torch.zeros(depths, dtype=torch.float64)
        self._token_counts = torch.zeros(depths, dtype=torch.float64)

    def take_mtp_losses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sums, token counts) per depth accumulated since the last call, and reset them."""
        taken = (self._loss_sums.clone(), self._token_counts.clone())
        self._loss_sums.zero_()
        self._token_counts.zero_()
        return taken

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                     rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None, decoder_input=None,
                     attention_mask=None, inference_params=None, packed_seq_params=None, sequence_len_offset=None,
                     runtime_gather_output=None, extra_block_kwargs=None, inference_context=None):
        if labels is not None or inference_context is not None:
            raise NotImplementedError("MTPGPTModel computes logits only (labels and Megatron's inference go "
                                      "through megatron-rl's own log-prob and rollout paths)")
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if self.mtp_targets is not None and self.mtp_process:
            hidden_states = self._with_mtp_loss(
                hidden_states, input_ids, position_ids, output_weight, dict(
                    attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                    rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
                    sequence_len_offset=sequence_len_offset, **(extra_block_kwargs or {})))
        if not self.post_process:
            return hidden_states
        logits, _ = self.output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v], as GPTModel without labels

    def _without_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """This TP rank's vocabulary shard of ``logits`` with the rows past the real vocabulary at -inf: their zero
        logits would join the softmax's denominator."""
        local = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * local
        padding = torch.arange(start, start + local, device=logits.device) >= self.hf_config.vocab_size
        return logits.masked_fill(padding, float("-inf")) if bool(padding.any()) else logits

    def _with_mtp_loss(self, hidden_states, input_ids, position_ids, output_weight, block_kwargs):
        targets = self.mtp_targets
        detach = targets.detach_encoder
        embedding = self.embedding
        if detach:
            def embedding(input_ids, position_ids):  # noqa: E306  (the MTP layers call it with keywords)
                return self.embedding(input_ids=input_ids, position_ids=position_ids).detach()
        source = hidden_states.detach() if detach else hidden_states
        stacked = self.mtp(input_ids=input_ids, position_ids=position_ids, hidden_states=source,
                           embedding=embedding, **block_kwargs)
        depths = self.config.mtp_num_layers
        head_weight = output_weight if output_weight is not None else self.output_layer.weight
        if detach:
            head_weight = head_weight.detach()
        for k, depth_hidden in enumerate(torch.chunk(stacked, 1 + depths, dim=0)[1:]):
            logits, _ = self.output_layer(depth_hidden, weight=head_weight, runtime_gather_output=False)
            logits = self._without_vocab_padding(logits)
            loss = self.compute_language_model_loss(targets.labels[k], logits) * targets.masks[k]  # [b, s]
            count = targets.masks[k].sum()
            self._loss_sums[k] += float(loss.detach().sum())
            self._token_counts[k] += float(count)
            per_token = loss.sum() / count.clamp(min=1)
            hidden_states = MTPLossAutoScaler.apply(hidden_states, per_token * targets.scale)
        return hidden_states
