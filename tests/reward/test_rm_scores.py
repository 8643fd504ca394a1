"""A Megatron reward model scores like transformers' ``*ForSequenceClassification`` (TP=1, TP=2, PP=2).

One spawned pair of gloo ranks runs every Megatron side (rm_jobs.py); the references run here.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from megatron_rl.distributed import run_multiprocess
from megatron_rl_testing.tiny_models import make_tiny_tokenizer
from megatron_rl.protocol import DataProto
from megatron_rl.reward.model.inputs import RewardModelInputs
from megatron_rl_testing.reward_models import make_tiny_reward_model
from rm_jobs import LAYOUTS, rm_checks

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4
FAMILIES = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 16}}


def token_rows() -> list[list[int]]:
    """Rows of different lengths (byte tokens, none equal to the pad id 256)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (12, 5, 9, 1, 7)]


# The RM's own chat template (the policy's is the tiny tokenizer's <|role|>...<|end|>).
RM_TEMPLATE = (
    "{% for message in messages %}### {{ message['role'] | upper }}: {{ message['content'] }}\n{% endfor %}"
)
CONVERSATIONS = [
    ([{"role": "user", "content": "copy: abc"}], "abc"),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}], "4, of course"),
    ([{"role": "user", "content": "say nothing"}], ""),
]


def policy_batch(policy_tokenizer) -> DataProto:
    """The conversations as the policy produced them: left-padded prompts, right-padded responses ending in
    EOS, with the chat messages in raw_prompt."""
    prompts = [policy_tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
               for m, _ in CONVERSATIONS]
    prompt_ids = [policy_tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    response_ids = [policy_tokenizer(r, add_special_tokens=False)["input_ids"] + [policy_tokenizer.eos_token_id]
                    for _, r in CONVERSATIONS]
    pad = policy_tokenizer.pad_token_id
    p_len, r_len = max(map(len, prompt_ids)), max(map(len, response_ids)) + 2
    ids, mask, responses, response_mask = [], [], [], []
    for p, r in zip(prompt_ids, response_ids):
        left, right = [pad] * (p_len - len(p)), [pad] * (r_len - len(r))
        ids.append(left + p + r + right)
        mask.append([0] * len(left) + [1] * (len(p) + len(r)) + [0] * len(right))
        responses.append(r + right)
        response_mask.append([1] * len(r) + [0] * len(right))
    raw = np.empty(len(CONVERSATIONS), dtype=object)
    raw[:] = [m for m, _ in CONVERSATIONS]
    return DataProto.from_dict(
        {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask),
         "responses": torch.tensor(responses), "response_mask": torch.tensor(response_mask)},
        {"raw_prompt": raw},
    )


@pytest.fixture(scope="module")
def rm_setup(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("rm")
    dirs = {name: str(make_tiny_reward_model(root / name, name, seed=i, **kw))
            for i, (name, kw) in enumerate(FAMILIES.items())}
    rm_tokenizer = AutoTokenizer.from_pretrained(dirs["qwen2"])
    rm_tokenizer.chat_template = RM_TEMPLATE
    rm_tokenizer.save_pretrained(dirs["qwen2"])
    policy_tokenizer = AutoTokenizer.from_pretrained(make_tiny_tokenizer(root / "policy"))
    batch = policy_batch(policy_tokenizer)
    extra = {
        "retokenized": RewardModelInputs(rm_tokenizer, policy_tokenizer)(batch)[0],
        "policy_tokens": RewardModelInputs(rm_tokenizer)(batch)[0],
    }
    extra_rows = {k: [row[m.bool()].tolist() for row, m in zip(v.batch["input_ids"], v.batch["attention_mask"])]
                  for k, v in extra.items()}
    results = run_multiprocess(rm_checks, 2, dirs, token_rows(), extra_rows, timeout_s=600)
    return dirs, results, rm_tokenizer


@functools.cache
def hf_scores(directory: str, rows: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """transformers' score of each row, each scored alone (no padding at all)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([row])).logits[0, 0] for row in rows])


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("tp, pp", LAYOUTS)
def test_megatron_rm_scores_match_sequence_classification(rm_setup, name, tp, pp):
    dirs, results, _ = rm_setup
    expected = hf_scores(dirs[name], tuple(map(tuple, token_rows())))
    assert expected.abs().max() > 0.1  # a real score, not a near-zero head
    for result in results:  # every rank of every layout answers with the same scores, whatever the padding
        for key in (name, f"{name}/left_pad"):
            diff = (result[key, tp, pp] - expected).abs().max().item()
            assert diff <= TOLERANCE, f"{key} TP={tp} PP={pp}: max |score diff| {diff:.2e}"


@pytest.mark.parametrize("variant", ["budget", "thd"])
def test_token_budget_and_packed_sequences_do_not_change_scores(rm_setup, variant):
    dirs, results, _ = rm_setup
    expected = hf_scores(dirs["qwen2"], tuple(map(tuple, token_rows())))
    for result in results:
        assert (result[variant] - expected).abs().max().item() <= TOLERANCE


def test_reward_model_checkpoint_has_no_bias_and_one_label(tmp_path):
    from megatron_rl.models.hf_config import UnsupportedModelError, load_hf_config
    from megatron_rl.models.layout import hf_tensor_groups

    rm = load_hf_config(make_tiny_reward_model(tmp_path / "rm", with_tokenizer=False))
    assert rm.sequence_classifier
    names = [t.name for g in hf_tensor_groups(rm, value_head=True) for t in g.tensors]
    assert names[-1] == "score.weight" and "score.bias" not in names
    two = make_tiny_reward_model(tmp_path / "two", with_tokenizer=False, num_labels=2)
    with pytest.raises(UnsupportedModelError, match="num_labels=2"):
        load_hf_config(two)


@pytest.mark.parametrize("tp, pp", LAYOUTS)
def test_rm_with_its_own_tokenizer_scores_the_text_as_if_scored_directly(rm_setup, tp, pp):
    dirs, results, rm_tokenizer = rm_setup
    # the reference: each conversation's text rendered and tokenized by the RM's tokenizer alone
    direct = tuple(
        tuple(rm_tokenizer(rm_tokenizer.apply_chat_template([*m, {"role": "assistant", "content": r}],
                                                            tokenize=False), add_special_tokens=False)["input_ids"])
        for m, r in CONVERSATIONS
    )
    expected = hf_scores(dirs["qwen2"], direct)
    for result in results:
        assert (result["retokenized", tp, pp] - expected).abs().max().item() <= TOLERANCE
        # the policy's own tokens (other template, EOS) would have been scored differently
        assert (result["policy_tokens", tp, pp] - expected).abs().min().item() > 1e-3
